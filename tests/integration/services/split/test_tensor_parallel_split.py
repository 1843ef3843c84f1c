"""Prefill and decode pools of different tensor-parallel sizes behind the router's dispatcher
(real gRPC, real KV store): P(TP 2) -> D(TP 1) and P(TP 1) -> D(TP 2) give the colocated TP 1
worker's tokens and logprobs for greedy, seeded and penalised samples, the decode worker loading
the prompt (no recompute). The early hand-off (the decode call sent beside the prefill) carries
the prefill pool's TP size, learned from the workers' Load replies; a prefill pool of mixed TP
sizes hands off after the prefill instead (its keys name their TP size)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from engine.sampling_params import SamplingParams
from kvstore.service import KVStoreService
from services.router.dispatch.dispatcher import Dispatcher, DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.conftest import running_together, worker_options
from tests.integration.services.split.test_split_sampling import BASE, CASES, PROMPT, _same, _sample

in_module_loop = pytest.mark.asyncio(loop_scope="module")
SIZES = {"p2": ("prefill", 2), "d1": ("decode", 1), "p1": ("prefill", 1), "d2": ("decode", 2),
         "c1": ("colocated", 1)}
PAIRS = {"p2d1": (("p2",), "d1"), "p1d2": (("p1",), "d2"), "mixed": (("p1", "p2"), "d1"),
         "colocated": ((), "c1")}
HANDOFFS: dict[str, list[str]] = {name: [] for name in PAIRS}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp_workers(model_dir: Path, store: KVStoreService) -> AsyncIterator[dict[str, WorkerServer]]:
    servers = {}
    for name, (role, tp) in SIZES.items():
        options = worker_options(model_dir, store, role)  # type: ignore[arg-type]
        engine = replace(options.engine, tensor_parallel_size=tp)
        servers[name] = WorkerServer(replace(options, engine=engine))
    async with running_together(servers) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dispatchers(tp_workers: dict[str, WorkerServer]) -> AsyncIterator[dict[str, Dispatcher]]:
    def record(name: str) -> Callable[[float, str], None]:
        return lambda _seconds, mode: HANDOFFS[name].append(mode)

    made = {name: Dispatcher(DispatchOptions(prefill=tuple(tp_workers[p].target for p in prefill),
                                             decode=(tp_workers[decode].target,)), on_handoff=record(name))
            for name, (prefill, decode) in PAIRS.items()}
    try:
        for d in made.values():
            d.start()
        deadline = time.monotonic() + 60
        workers = [w for d in made.values() for p in d.pools for w in p.workers]
        while not all(w.load is not None and w.healthy for w in workers):
            assert time.monotonic() < deadline, "workers never reported serving"
            await asyncio.sleep(0.05)
        yield made
    finally:
        for d in made.values():
            await d.close()


async def _transfers(worker: WorkerServer) -> tuple[int, int]:
    """The decode worker's (load failures, bytes loaded) so far."""
    assert worker.guard.engine is not None
    stats = (await worker.guard.engine.get_stats()).kv_transfer
    assert stats is not None
    return stats.load_failures, stats.load_bytes


@in_module_loop
@pytest.mark.parametrize("case", ["greedy-penalties", "t0.7-seed", "everything", "logit-bias"])
@pytest.mark.parametrize("pair", ["p2d1", "p1d2"])
async def test_split_across_tp_sizes_equals_colocated(dispatchers: dict[str, Dispatcher],
                                                      tp_workers: dict[str, WorkerServer], pair: str,
                                                      case: str) -> None:
    params = SamplingParams(**{**BASE, **CASES[case]})
    decode = tp_workers[PAIRS[pair][1]]
    failures, loaded = await _transfers(decode)
    split, colocated = await asyncio.gather(_sample(dispatchers[pair], f"{pair}-{case}", params),
                                            _sample(dispatchers["colocated"], f"c-{pair}-{case}", params))
    _same(split, colocated)
    assert HANDOFFS[pair][-1] == "early"  # the prefill pool's one TP size, learned from its reports
    now_failures, now_loaded = await _transfers(decode)
    assert now_failures == failures and now_loaded > loaded  # the prompt's KV came from the store


@in_module_loop
async def test_a_prefill_pool_of_mixed_tp_sizes_hands_off_after_the_prefill(
        dispatchers: dict[str, Dispatcher]) -> None:
    assert dispatchers["mixed"].prefill is not None
    assert sorted(w.tp_size for w in dispatchers["mixed"].prefill.workers) == [1, 2]
    assert dispatchers["mixed"].prefill.shared_tp_size() is None
    params = SamplingParams(**{**BASE, **CASES["everything"]})
    for i in range(2):  # both prefill workers get one (prefix-aware: the second goes elsewhere)
        prompt = PROMPT[i:]
        mixed, colocated = await asyncio.gather(
            _sample(dispatchers["mixed"], f"mixed-{i}", params, prompt),
            _sample(dispatchers["colocated"], f"c-mix-{i}", params, prompt))
        _same(mixed, colocated)
    assert HANDOFFS["mixed"] == ["after_prefill", "after_prefill"]
