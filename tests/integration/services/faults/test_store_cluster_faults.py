"""A prefill and a decode worker whose KV store is three `pdserve kvstore --backend redis-cluster`
front-ends over a 3-master Redis Cluster (`--kv-store-url grpc://a,grpc://b,grpc://c`), under
a bounded load of streamed requests through the router: a front-end killed (SIGKILL), then a
Redis master killed (SIGKILL), and every request still ends with the greedy text the same
system gave before any fault (what cannot be loaded is recomputed; what cannot be stored is
dropped), none fails. (That the unfaulted P/D text equals a single engine's is
test_store_faults.py's; not repeated here, it would cost another engine start.)
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from engine.config import EngineConfig
from loadtest.redis_cluster import RedisCluster, free_port_in, missing_tools
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerOptions, WorkerServer
from tests.integration.kvstore.cluster_util import frontends, location
from tests.integration.services.faults.test_store_faults import MODEL, PROMPTS, load_bytes, run_load
from tests.integration.services.procs_util import Proc
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    why = missing_tools()
    if why is not None:
        pytest.skip(why)
    with RedisCluster(tmp_path_factory.mktemp("pd-cluster"), low=21000, high=21500) as c:
        yield c


@pytest.fixture(scope="module")
def fronts(cluster: RedisCluster) -> Iterator[list[Proc]]:
    procs = frontends(cluster.url, 3)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd(model_dir: Path, fronts: list[Proc]) -> AsyncIterator[dict[str, WorkerServer]]:
    config = EngineConfig(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96,
                          kv_store_url=location(fronts), kv_store_timeout_s=2.0)
    taken: set[int] = set()
    servers = {role: WorkerServer(WorkerOptions(role=role, engine=replace(config),
                                                port=free_port_in(21500, 22000, taken)))
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


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def expected(router: ServedRouter) -> dict[str, str]:
    """Every prompt's text before any fault (3 rounds of 4 users cover all 8 prompts)."""
    results, _ = await run_load(router, rounds=3)
    texts = dict(results)
    assert set(texts) == set(PROMPTS)
    assert all(text == texts[p] for p, text in results)  # deterministic, reloaded KV or not
    return texts


@in_module_loop
async def test_a_front_end_killed_under_load_fails_no_request_and_kv_still_flows(
        router: ServedRouter, pd: dict[str, WorkerServer], fronts: list[Proc],
        expected: dict[str, str]) -> None:
    before = await load_bytes(pd["decode"])
    results, _ = await run_load(router, rounds=3, during=lambda: fronts[0].signal(signal.SIGKILL))
    assert len(results) == 12 and all(text == expected[p] for p, text in results)
    mid = await load_bytes(pd["decode"])
    assert mid > before
    results, _ = await run_load(router, rounds=1)
    assert all(text == expected[p] for p, text in results)
    assert await load_bytes(pd["decode"]) > mid  # the other two front-ends carry the KV


@in_module_loop
async def test_a_redis_master_killed_under_load_fails_no_request(
        router: ServedRouter, cluster: RedisCluster, expected: dict[str, str]) -> None:
    results, slowest = await run_load(router, rounds=3, during=lambda: cluster.kill(0))
    assert len(results) == 12 and all(text == expected[p] for p, text in results)
    assert slowest < 30
    results, _ = await run_load(router, rounds=1)  # after the loss, with a third of the slots gone
    assert all(text == expected[p] for p, text in results)
