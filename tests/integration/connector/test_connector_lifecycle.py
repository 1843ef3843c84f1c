"""Lifetimes around the connector: an abort while a request's KV is still arriving frees its
blocks only once the load stopped writing into them; leases taken for a transfer end on the
consumer's acknowledgement; kv_transfer_params in and out of the engine core."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.outputs import EngineCoreRequest
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kvstore.backend import KVObject
from kvstore.backends.memory import MemoryBackend
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService, StoreOptions


class SlowGets(MemoryBackend):
    def get(self, key: str) -> KVObject | None:
        time.sleep(0.05)
        return super().get(key)


def core(model: Path, url: str, role: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), num_threads=1, kv_cache_gib=0.05,
                                   kv_connector="kvstore", kv_role=role, kv_store_url=url,
                                   kv_load_mode="async"))  # the WAITING_FOR_REMOTE_KVS path


def run(engine: EngineCore, req: EngineCoreRequest,
        limit_s: float = 60) -> tuple[list[int], dict[str, Any] | None]:
    """Steps until the request ends: its tokens and its final kv_transfer_params."""
    engine.add_request(req)
    tokens: list[int] = []
    params = None
    deadline = time.monotonic() + limit_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step().outputs:
            tokens += out.new_token_ids
            if out.finished:
                params = out.kv_transfer_params
    return tokens, params


def greedy(n: int, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=params)


def test_abort_while_loading_frees_blocks_after_the_load_stops(long_model_dir: Path) -> None:
    backend = SlowGets(2**28)
    with KVStoreService(StoreOptions(port=0), backend=backend) as store:
        producer = core(long_model_dir, store.location, "kv_producer")
        consumer = core(long_model_dir, store.location, "kv_consumer")
        prompt = list(range(100, 700))
        first, params = run(producer, EngineCoreRequest("p", prompt, greedy(1, {"do_remote_decode": True})))
        assert params is not None and params["num_tokens"] == 600
        with KVStoreClient(store.location) as c:
            assert c.stats().leased == len(params["keys"]) * 3
        start = consumer.get_stats()
        consumer.add_request(EngineCoreRequest("d", prompt + first, greedy(4, params)))
        consumer.step()  # allocated, waiting for remote KV, load under way (slow store)
        assert consumer.scheduler.waiting_for_kv
        assert consumer.get_stats().num_free_blocks < start.num_free_blocks
        consumer.abort_requests(["d"])
        deadline = time.monotonic() + 30
        while consumer.has_unfinished_requests():
            assert time.monotonic() < deadline
            consumer.step()
        assert consumer.get_stats().num_free_blocks == start.num_free_blocks
        for engine in (producer, consumer):
            engine.shutdown()


def test_consumer_acknowledgement_ends_the_lease(store: KVStoreService, long_model_dir: Path) -> None:
    producer = core(long_model_dir, store.location, "kv_producer")
    consumer = core(long_model_dir, store.location, "kv_consumer")
    prompt = list(range(200, 500))
    first, params = run(producer, EngineCoreRequest(
        "p", prompt, greedy(1, {"do_remote_decode": True, "transfer_id": "xfer-7"})))
    assert params is not None and params["transfer_id"] == "xfer-7" and params["do_remote_prefill"] is True
    with KVStoreClient(store.location) as c:
        assert c.stats().leased > 0
        out, _ = run(consumer, EngineCoreRequest("d", prompt + first, greedy(3, params)))
        assert len(out) == 3
        assert c.stats().leased == 0
    for engine in (producer, consumer):
        engine.shutdown()


def colocated_tokens(model: Path, prompt: list[int], n: int) -> list[int]:
    engine = EngineCore(EngineConfig(model=str(model), num_threads=1, kv_cache_gib=0.05))
    tokens, _ = run(engine, EngineCoreRequest("c", prompt, greedy(n)))
    return tokens


def test_loaded_requests_holding_blocks_do_not_block_each_other(store: KVStoreService,
                                                                long_model_dir: Path) -> None:
    """8 usable blocks, two 65-token requests whose 64 loaded tokens fill 4 blocks each: one
    of them gives its blocks back (its KV stays cached) instead of both waiting forever."""
    producer = core(long_model_dir, store.location, "kv_producer")
    consumer = EngineCore(EngineConfig(model=str(long_model_dir), num_threads=1, num_kv_blocks=9,
                                       max_model_len=128, kv_connector="kvstore",
                                       kv_role="kv_consumer", kv_store_url=store.location))
    prompts = [list(range(300 + 100 * i, 364 + 100 * i)) for i in range(2)]
    jobs = []
    for i, prompt in enumerate(prompts):
        remote = greedy(1, {"do_remote_decode": True})
        first, params = run(producer, EngineCoreRequest(f"p{i}", prompt, remote))
        jobs.append((prompt + first, params, first))
    for i, (ids, params, _) in enumerate(jobs):
        consumer.add_request(EngineCoreRequest(f"d{i}", ids, greedy(4, params)))
    got: dict[str, list[int]] = {"d0": [], "d1": []}
    deadline = time.monotonic() + 60
    while consumer.has_unfinished_requests():
        assert time.monotonic() < deadline, "the consumer hung"
        for out in consumer.step().outputs:
            got[out.request_id] += out.new_token_ids
    for i, (_, _, first) in enumerate(jobs):
        assert first + got[f"d{i}"] == colocated_tokens(long_model_dir, prompts[i], 5)
    assert consumer.get_stats().num_free_blocks == consumer.get_stats().num_total_blocks
    for engine in (producer, consumer):
        engine.shutdown()


def test_a_transfer_of_part_of_the_prompt_computes_the_rest(store: KVStoreService,
                                                            long_model_dir: Path) -> None:
    """Params naming 40 tokens of a 100-token prompt: 40 load, the other 60 are computed."""
    producer = core(long_model_dir, store.location, "kv_producer")
    consumer = core(long_model_dir, store.location, "kv_consumer")
    prompt = list(range(1000, 1100))
    _, params = run(producer, EngineCoreRequest("p", prompt[:40], greedy(1, {"do_remote_decode": True})))
    assert params is not None and params["num_tokens"] == 40
    got, _ = run(consumer, EngineCoreRequest("d", prompt, greedy(5, params)))
    assert got == colocated_tokens(long_model_dir, prompt, 5)
    assert consumer.get_stats().num_free_blocks == consumer.get_stats().num_total_blocks
    for engine in (producer, consumer):
        engine.shutdown()
