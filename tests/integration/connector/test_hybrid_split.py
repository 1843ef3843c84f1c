"""Disaggregated serving of a hybrid model (Gemma 3: local layers with a 24-key window beside a
global layer) through a real KV store: the consumer frees its local layers' blocks (one KV cache
group per kind, engine/core/kv_layout.py) and loads, for the local layers, only the chunks in the
window of the first token it computes, for the global layer all of them. Greedy tokens equal a
colocated engine's; a missing object of a local layer recomputes to the same tokens; nothing
leaks and every transfer is acknowledged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService

BLOCK = CHUNK = 16
NEW = 12
LENGTHS = [17, 60, 130]


def _llm(model: Path, **kw: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=str(model), num_threads=1, block_size=BLOCK, kv_chunk_size=CHUNK, **kw)


def _greedy(n: int, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=params)


def _prompts() -> list[list[int]]:
    return [[100 + (11 * i + 5 * j) % 800 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _split(store: KVStoreService, model: Path, load_mode: str, delete: Callable[[list[str]], list[str]]
           ) -> tuple[list[list[int]], Any, Any]:
    producer = _llm(model, kv_connector="kvstore", kv_role="kv_producer", kv_store_url=store.location)
    consumer = _llm(model, kv_connector="kvstore", kv_role="kv_consumer", kv_store_url=store.location,
                    kv_load_mode=load_mode)
    prompts = _prompts()
    firsts = producer.generate(
        prompts, [_greedy(1, {"do_remote_decode": True, "transfer_id": f"t{i}"})
                  for i in range(len(prompts))], use_tqdm=False)
    params = [o.kv_transfer_params for o in firsts]
    gone = delete([k for p in params for k in p["keys"]])
    if gone:
        with KVStoreClient(store.location) as c:
            c.delete(gone)
    outs = consumer.generate([[*p, o.outputs[0].token_ids[0]] for p, o in zip(prompts, firsts, strict=True)],
                             [_greedy(NEW - 1, p) for p in params], use_tqdm=False)
    tokens = [[f.outputs[0].token_ids[0], *o.outputs[0].token_ids]
              for f, o in zip(firsts, outs, strict=True)]
    for engine in (producer, consumer):
        stats = engine.engine_core.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    with KVStoreClient(store.location) as c:
        assert c.stats().leased == 0
    return tokens, producer, consumer


@pytest.fixture(scope="module")
def gemma3(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("gemma3")  # layers: local, local, global


@pytest.fixture(scope="module")
def colocated(gemma3: Path) -> list[list[int]]:
    outs = _llm(gemma3).generate(_prompts(), _greedy(NEW), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_a_hybrid_consumer_loads_the_window_and_equals_colocated(
        store: KVStoreService, gemma3: Path, colocated: list[list[int]], load_mode: str) -> None:
    tokens, producer, consumer = _split(store, gemma3, load_mode, lambda keys: [])
    assert tokens == colocated
    assert not producer.engine_core.kv_layout.is_hybrid  # a producer keeps every block
    layout = consumer.engine_core.kv_layout
    assert layout.is_hybrid and layout.windows == (24, 24, None)  # a group of one layer each
    # What the consumer fetched: the global layer every chunk of each prompt; a local layer the
    # chunks from the block the window of token n (the first it computes) starts in.
    kv = consumer.engine_core.runner.kv_caches[0]
    per_token = 2 * kv.shape[3] * kv.shape[4] * kv.element_size()

    def tokens_from(start: int, n: int) -> int:
        return n - start // CHUNK * CHUNK

    windowed = [tokens_from(max(0, n - 24 + 1) // BLOCK * BLOCK, n) for n in LENGTHS]
    want = sum(LENGTHS) * per_token + 2 * sum(windowed) * per_token
    stats = consumer.engine_core.runner.connector.get_transfer_stats()
    assert stats.load_bytes == want < 3 * sum(LENGTHS) * per_token
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


@pytest.mark.parametrize("layer", [0, 2])
def test_a_missing_object_recomputes_to_the_same_tokens(
        store: KVStoreService, gemma3: Path, colocated: list[list[int]], layer: int) -> None:
    """The last chunk of a local (0) or the global (2) layer is gone: the load is cut short,
    and the request computes from its start (a local group skipped blocks it would now need)."""
    def last_chunks(keys: list[str]) -> list[str]:
        return [f"{keys[-1]}@{layer}"]  # the longest prompt's last chunk

    tokens, producer, consumer = _split(store, gemma3, "async", last_chunks)
    assert tokens == colocated
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()
