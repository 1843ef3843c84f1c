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
                                   kv_connector="kvstore", kv_role=role, kv_store_url=url))


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
