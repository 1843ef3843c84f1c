"""The KV store as a process that fails under load: killed (SIGKILL) while requests stream through
a prefill and a decode worker, every request still ends with the greedy text (the decode worker
recomputes what it cannot load); restarted on its port, transfers through it resume. Frozen
(SIGSTOP), requests go on within a bound: calls time out once, then the workers leave the store
alone for a while (kvstore/link.py's breaker) instead of waiting on every call."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from kvstore.client import KVStoreClient, KVStoreClientError
from services.procs import free_port
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerOptions, WorkerServer
from tests.integration.services.procs_util import Proc, store_proc
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPTS = [f"Request {i} about the store: " + "words " * (20 + 7 * i) for i in range(8)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False),
                                                     strict=True)}


@pytest.fixture(scope="module")
def store_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def store(store_port: int) -> Iterator[list[Proc]]:
    """The store process (a list: a test replaces it after killing it)."""
    procs = [store_proc(store_port).wait_ready()]
    try:
        yield procs
    finally:
        procs[-1].stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd(model_dir: Path, store: list[Proc]) -> AsyncIterator[dict[str, WorkerServer]]:
    config = EngineConfig(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96,
                          kv_store_url=f"grpc://{store[0].target}", kv_store_timeout_s=2.0)
    servers = {role: WorkerServer(WorkerOptions(role=role, engine=replace(config), port=free_port()))
               for role in ("prefill", "decode")}
    try:
        await asyncio.gather(*(server.start() for server in servers.values()))
        yield servers
    finally:
        for server in servers.values():
            await server.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def router(pd: dict[str, WorkerServer], model_dir: Path) -> Iterator[ServedRouter]:
    dispatch = DispatchOptions(prefill=(pd["prefill"].target,), decode=(pd["decode"].target,),
                               prefill_timeout_s=60, decode_timeout_s=60)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


async def load_bytes(server: WorkerServer) -> int:
    engine = server.guard.engine
    assert engine is not None
    stats = await engine.get_stats()
    assert stats.kv_transfer is not None
    return stats.kv_transfer.load_bytes


async def run_load(router: ServedRouter, rounds: int, during: object = None
                   ) -> tuple[list[tuple[str, str]], float]:
    """4 users stream `rounds` prompts each; `during()` runs once 4 requests are done. Returns
    (prompt, text) per request and the slowest request's seconds."""
    results: list[tuple[str, str]] = []
    slowest = 0.0
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60) as c:

        async def user(u: int) -> None:
            nonlocal slowest
            for i in range(rounds):
                prompt = PROMPTS[(u + 3 * i) % len(PROMPTS)]
                start = time.monotonic()
                stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                                    temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
                results.append((prompt, "".join([ch.choices[0].text async for ch in stream])))
                slowest = max(slowest, time.monotonic() - start)

        users = [asyncio.create_task(user(u)) for u in range(4)]
        if during is not None:
            while len(results) < 4:
                await asyncio.sleep(0.01)
            during()  # type: ignore[operator]
        await asyncio.wait_for(asyncio.gather(*users), timeout=180)
    return results, slowest


@in_module_loop
async def test_a_killed_store_loses_no_request_and_transfers_resume_once_it_restarts(
        router: ServedRouter, pd: dict[str, WorkerServer], store: list[Proc], store_port: int,
        expected: dict[str, str]) -> None:
    before = await load_bytes(pd["decode"])
    results, _ = await run_load(router, rounds=4, during=lambda: store[-1].signal(signal.SIGKILL))
    assert len(results) == 16 and all(text == expected[p] for p, text in results)
    assert await load_bytes(pd["decode"]) > before  # some loaded before the kill

    store.append(store_proc(store_port).wait_ready())  # the same port: the workers' URL
    await asyncio.sleep(2.5)  # past the workers' breaker (kv_store_timeout_s)
    mid = await load_bytes(pd["decode"])
    results, _ = await run_load(router, rounds=1)
    assert all(text == expected[p] for p, text in results)
    assert await load_bytes(pd["decode"]) > mid  # KV goes through the new store again


@in_module_loop
async def test_a_frozen_store_delays_requests_within_a_bound_and_fails_none(
        router: ServedRouter, store: list[Proc], expected: dict[str, str]) -> None:
    frozen = store[-1]
    try:
        results, slowest = await run_load(router, rounds=2, during=lambda: frozen.signal(signal.SIGSTOP))
    finally:
        frozen.signal(signal.SIGCONT)
    assert len(results) == 8 and all(text == expected[p] for p, text in results)
    assert slowest < 30  # one 2 s call timeout per client, then no waiting on the store


def test_the_client_breaker_fails_fast_after_a_timeout_and_recovers(store: list[Proc]) -> None:
    client = KVStoreClient(f"grpc://{store[-1].target}", timeout_s=1.0, breaker_s=2.0, use_shm=False)
    try:
        assert client.lookup(["m@1@0@7b@float@0"]) == 0
        store[-1].freeze()
        start = time.monotonic()
        with pytest.raises(KVStoreClientError, match="timed out"):
            client.lookup(["m@1@0@7b@float@0"])
        assert 0.9 < time.monotonic() - start < 5
        start = time.monotonic()
        with pytest.raises(KVStoreClientError, match="not asked again"):
            client.lookup(["m@1@0@7b@float@0"])
        assert time.monotonic() - start < 0.2
        store[-1].signal(signal.SIGCONT)
        time.sleep(2.1)
        assert client.lookup(["m@1@0@7b@float@0"]) == 0
    finally:
        store[-1].signal(signal.SIGCONT)
        client.close()
