"""Health that tells the truth: a worker whose engine core is killed reports NOT_SERVING (gRPC
health and Load, with the reason), fails the request it was running with UNAVAILABLE, restarts
its core and serves again with the same output; a core frozen briefly makes the worker unready
without a restart, one frozen past the silence limit is replaced; a worker out of engine restarts
exits 1 for its supervisor. Hostile kv_transfer values never take the engine down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from services.procs import free_port
from services.worker.client import WorkerClient, WorkerError
from services.worker.engine_guard import GuardOptions
from services.worker.server import LIVENESS, WorkerOptions, WorkerServer
from tests.integration.services.procs_util import worker_proc

in_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPT = list(range(100, 140))
GUARD = GuardOptions(check_s=0.1, unready_after_s=1.0, silence_s=3.0, max_restarts=5)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@contextlib.asynccontextmanager
async def guarded_worker(model_dir: Path, **engine: Any) -> AsyncIterator[WorkerServer]:
    """A colocated worker whose guard reacts fast (GUARD), on the tiny model."""
    config = EngineConfig(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96, **engine)
    server = WorkerServer(WorkerOptions(role="colocated", engine=config, port=free_port(), guard=GUARD,
                                        heartbeat_s=0.2))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(model_dir: Path) -> AsyncIterator[WorkerServer]:
    async with guarded_worker(model_dir) as server:
        yield server


def core_pid(server: WorkerServer) -> int:
    engine = server.guard.engine
    assert engine is not None
    return int(engine.engine_core.proc.pid)  # type: ignore[attr-defined]


async def tokens(client: WorkerClient, rid: str, n: int) -> list[int]:
    return [t async for c in client.decode(rid, PROMPT, greedy(n)) for t in c.token_ids]


async def until(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not seen in {timeout_s} s"
        await asyncio.sleep(0.02)


@in_module_loop
async def test_a_killed_engine_core_fails_its_request_reports_not_serving_and_comes_back(
        worker: WorkerServer) -> None:
    async with WorkerClient(worker.target) as client:
        want = await tokens(client, "before", 8)
        pid = core_pid(worker)
        seen: list[str] = []

        async def long_stream() -> None:
            async for c in client.decode("victim", PROMPT, greedy(400)):
                seen.extend(map(str, c.token_ids))

        stream = asyncio.create_task(long_stream())
        await until(lambda: _true(len(seen) > 2), 30, "the long stream's first tokens")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError) as err:
            await asyncio.wait_for(stream, 30)
        assert err.value.kind == "unavailable" and err.value.down

        reports = []

        async def not_serving() -> bool:
            reports.append(await client.load())
            return not reports[-1].serving and not await client.health()

        await until(not_serving, 10, "NOT_SERVING")
        assert "engine core" in reports[-1].not_serving_reason
        assert await client.health(LIVENESS)  # alive: it recovers by itself

        async def serving() -> bool:
            return (await client.load()).serving and await client.health()

        await until(serving, 120, "SERVING again")
        assert core_pid(worker) != pid
        assert await tokens(client, "after", 8) == want
        assert len(worker.guard.restarts) == 1


@in_module_loop
async def test_a_briefly_frozen_core_makes_the_worker_unready_without_a_restart(
        worker: WorkerServer) -> None:
    pid = core_pid(worker)
    restarts = len(worker.guard.restarts)
    async with WorkerClient(worker.target) as client:
        os.kill(pid, signal.SIGSTOP)
        try:
            await until(lambda: _not(client.health()), 5, "NOT_SERVING while frozen")
            assert "silent" in (await client.load()).not_serving_reason
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(client.health, 5, "SERVING after the thaw")
        assert core_pid(worker) == pid and len(worker.guard.restarts) == restarts
        assert len(await tokens(client, "thawed", 4)) == 4


@in_module_loop
async def test_a_core_frozen_past_the_silence_limit_is_replaced(worker: WorkerServer) -> None:
    pid = core_pid(worker)
    async with WorkerClient(worker.target) as client:
        os.kill(pid, signal.SIGSTOP)
        try:
            await until(lambda: _true(core_pid_or_none(worker) not in (None, pid)), 60, "a new core")
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        await until(client.health, 120, "SERVING with the new core")
        assert not _alive(pid)
        assert len(await tokens(client, "replaced", 4)) == 4


@pytest.mark.asyncio
async def test_a_worker_out_of_engine_restarts_exits_non_zero(model_dir: Path, tmp_path: Path) -> None:
    proc = worker_proc("colocated", model_dir, "grpc://127.0.0.1:1", "--max-engine-restarts", "0",
                       log=tmp_path / "worker.log")
    try:
        await asyncio.to_thread(proc.wait_ready)
        os.kill(proc.core_pid(), signal.SIGKILL)
        code = await asyncio.to_thread(proc.proc.wait, 60)
        assert code == 1
        assert "engine restarts" in (tmp_path / "worker.log").read_text()
    finally:
        proc.stop()


def core_pid_or_none(server: WorkerServer) -> int | None:
    engine = server.guard.engine
    return None if engine is None else int(engine.engine_core.proc.pid)  # type: ignore[attr-defined]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


async def _true(value: bool) -> bool:
    return value


async def _not(check: object) -> bool:
    return not await check  # type: ignore[misc]
