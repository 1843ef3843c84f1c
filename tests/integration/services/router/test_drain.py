"""`pdserve drain` (a Kubernetes worker pod's preStop hook) against a real router over a real worker:
it takes the worker out of the router, returns only once the request running there has finished,
reports a timeout with the request still running, and says when no router accepted it.

A tiny model streams 400 tokens in well under a second, so a request left running could finish
before the drain's first look. The tests hold it instead: the worker's engine core is stopped
(SIGSTOP) while the drain must see the request in flight, so it cannot finish then, however fast
the machine; the worker's guard and the router's stall watch are set not to act on that pause."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from kvstore.service import KVStoreService
from services.cli import main
from services.drain import drain
from services.procs import free_port
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.engine_guard import GuardOptions
from services.worker.server import WorkerServer
from tests.integration.services.conftest import worker_options
from tests.integration.services.procs_util import all_threads_stopped
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
ADMIN_KEY = "admin-s3cret"
HOLD_S = 60  # longest a test holds the core stopped: neither the guard nor the router acts sooner


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def colocated_worker(model_dir: Path, store: KVStoreService) -> AsyncIterator[WorkerServer]:
    """A colocated worker whose guard calls its core neither unready nor silent within HOLD_S."""
    guard = GuardOptions(unready_after_s=HOLD_S, silence_s=HOLD_S)
    server = WorkerServer(worker_options(model_dir, store, "colocated", guard=guard))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


@contextlib.contextmanager
def core_stopped(worker: WorkerServer) -> Iterator[None]:
    """Inside, the worker's engine core is stopped: its requests make no progress."""
    engine = worker.guard.engine
    assert engine is not None
    pid = int(engine.engine_core.proc.pid)  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while not all_threads_stopped(pid):  # a busy thread stops a moment after the signal
            assert time.monotonic() < deadline, f"core {pid} did not stop"
            time.sleep(0.005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def router(colocated_worker: WorkerServer, model_dir: Path) -> Iterator[ServedRouter]:
    """A router of this test's own (a drained worker stays drained in it), with an admin key;
    a stream silent while its worker's core is held is not moved elsewhere."""
    dispatch = DispatchOptions(decode=(colocated_worker.target,), decode_timeout_s=120,
                               stall_timeout_s=HOLD_S)
    config = RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch,
                          admin_keys=(ADMIN_KEY,))
    with ServedRouter(config) as served:
        yield served


async def _workers(router: ServedRouter) -> dict[str, dict[str, object]]:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {ADMIN_KEY}"}) as http:
        r = await http.get(f"{router.url}/admin/workers")
        return {w["target"]: w for w in r.json()["workers"]}


@in_module_loop
async def test_drain_waits_for_the_request_in_flight_in_every_router(
        router: ServedRouter, colocated_worker: WorkerServer) -> None:
    target = colocated_worker.target
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key=ADMIN_KEY, max_retries=0) as c:
        stream = await c.completions.create(model="tiny", prompt="A long story:", max_tokens=400,
                                            temperature=0, stream=True)
        first = await anext(aiter(stream))  # running on the worker now
        unreachable = f"http://127.0.0.1:{free_port()}"  # a router that went away: reported, not waited on
        # dns:NAME:PORT, as the pods' hook names the routers' headless Service
        routers = [f"dns:127.0.0.1:{router.port}", unreachable]
        with core_stopped(colocated_worker):  # the stream cannot finish before the drain looks
            draining = asyncio.create_task(asyncio.to_thread(drain, routers, "colocated", target, 60.0,
                                                             ADMIN_KEY))
            for _ in range(100):
                if (await _workers(router))[target]["draining"]:
                    break
                await asyncio.sleep(0.05)
            assert (await _workers(router))[target]["draining"]
            await asyncio.sleep(1.5)  # the drain has looked at least twice (every 0.5 s)
            assert not draining.done()  # the stream still runs there
        rest = [chunk async for chunk in stream]
        finished = time.monotonic()
        result = await draining
        assert time.monotonic() >= finished
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert result.ok and result.drained == (router.url,) and result.busy == ()
    assert result.unreachable == (unreachable,)
    assert (await _workers(router))[target]["inflight"] == 0


@in_module_loop
async def test_drain_reports_a_timeout_with_the_request_still_running(
        router: ServedRouter, colocated_worker: WorkerServer) -> None:
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key=ADMIN_KEY, max_retries=0) as c:
        stream = await c.completions.create(model="tiny", prompt="Another story:", max_tokens=400,
                                            temperature=0, stream=True)
        await anext(aiter(stream))
        with core_stopped(colocated_worker):  # the request cannot finish within the timeout
            t0 = time.monotonic()
            result = await asyncio.to_thread(drain, [router.url], "colocated", colocated_worker.target,
                                             0.3, ADMIN_KEY)
            assert time.monotonic() - t0 < 10
        assert not result.ok and result.busy == (router.url,)
        rest = [chunk async for chunk in stream]  # the drained worker still finishes it
    assert rest[-1].choices[0].finish_reason == "length"


@in_module_loop
async def test_the_command_exits_0_for_a_worker_no_router_knows_and_1_without_the_admin_key(
        router: ServedRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["drain", "--router", router.url, "--role", "colocated", "--timeout-s", "5"]
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", ADMIN_KEY)
    gone = f"127.0.0.1:{free_port()}"  # removed already (its address left the Service)
    assert await asyncio.to_thread(main, [*args, "--target", gone]) == 0
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "wrong")
    assert await asyncio.to_thread(main, [*args, "--target", gone]) == 1  # refused: nothing drained
