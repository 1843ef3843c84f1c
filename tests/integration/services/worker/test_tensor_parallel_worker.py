"""A worker whose engine is split over 2 ranks (tensor parallelism, CPU processes): its Load
reply says so; a rank killed while a stream runs fails that stream with UNAVAILABLE, the worker
says NOT_SERVING, and its guard builds the whole group anew (same output after), leaving no rank
process behind; a rank that freezes fails the step within tp_timeout_s and is replaced the same
way."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from services.worker.client import WorkerClient, WorkerError
from services.worker.server import WorkerServer
from tests.integration.services.faults.test_truthful_health import (
    PROMPT,
    greedy,
    guarded_worker,
    tokens,
    until,
)

in_module_loop = pytest.mark.asyncio(loop_scope="module")
TP_TIMEOUT_S = 5.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(model_dir: Path) -> AsyncIterator[WorkerServer]:
    async with guarded_worker(model_dir, tensor_parallel_size=2, tp_timeout_s=TP_TIMEOUT_S) as server:
        yield server


def ranks(server: WorkerServer) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine core (rank 0) and its other ranks."""
    engine = server.guard.engine
    assert engine is not None
    core = psutil.Process(engine.engine_core.proc.pid)  # type: ignore[attr-defined]
    return core, [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


async def _fault_then_recover(worker: WorkerServer, fault: str) -> float:
    """Applies `fault` to rank 1 while a stream runs; returns how long the stream took to fail."""
    async with WorkerClient(worker.target) as client:
        assert (await client.load()).tensor_parallel_size == 2
        want = await tokens(client, f"before-{fault}", 8)
        core, others = ranks(worker)
        assert len(others) == 1
        restarts = len(worker.guard.restarts)
        seen: list[int] = []

        async def long_stream() -> None:
            async for c in client.decode(f"victim-{fault}", PROMPT, greedy(400)):
                seen.extend(c.token_ids)

        stream = asyncio.create_task(long_stream())
        await until(lambda: _true(len(seen) > 2), 30, "the long stream's first tokens")
        os.kill(others[0].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            await asyncio.wait_for(stream, 60)
        failed_after = time.monotonic() - start
        assert err.value.kind == "unavailable"
        print(f"rank 1 {fault}: the stream failed after {failed_after:.2f} s")  # (the note's figure)

        async def not_serving() -> bool:  # until its guard has a new group up
            report = await client.load()
            return not report.serving and not await client.health()

        await until(not_serving, 10, "NOT_SERVING")

        async def serving_anew() -> bool:
            return len(worker.guard.restarts) > restarts and (await client.load()).serving

        await until(serving_anew, 120, "SERVING with a new group")
        print(f"rank 1 {fault}: serving again {time.monotonic() - start:.2f} s after the fault")
        assert await tokens(client, f"after-{fault}", 8) == want
        await until(lambda: _true(gone(core) and gone(others[0])), 10, "the old ranks gone")
        return failed_after


@in_module_loop
async def test_a_killed_rank_fails_its_stream_and_the_group_is_rebuilt(worker: WorkerServer) -> None:
    assert await _fault_then_recover(worker, "kill") < 5.0


@in_module_loop
async def test_a_frozen_rank_fails_the_step_within_the_tp_timeout_and_is_replaced(
        worker: WorkerServer) -> None:
    assert await _fault_then_recover(worker, "freeze") < TP_TIMEOUT_S + 5.0


async def _true(value: bool) -> bool:
    return value
