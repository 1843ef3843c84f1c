"""Disaggregated prefill/decode between engines of different tensor-parallel sizes, through a real
KV store: each rank's head shard is its own object under the LMCache key of that rank (the real
world size and worker id), and a consumer of another TP size re-shards on load. The consumer's
greedy and seeded tokens equal one colocated engine of one rank, it loads the whole prompt (no
recompute), and every lease is released."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.connector.kv_shards import rank_key
from engine.sampling_params import SamplingParams
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService
from tests.integration.connector.test_disaggregated import llm, prompt_of

LENGTHS = [17, 256, 700]
NEW = 8


def _params(kind: str, n: int, transfer: dict[str, Any] | None) -> SamplingParams:
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7} if kind == "seeded" else {"temperature": 0.0}
    return SamplingParams(max_tokens=n, ignore_eos=True, kv_transfer_params=transfer, **sampled)


def _split(producer: Any, consumer: Any, prompts: list[list[int]], kind: str) -> list[list[int]]:
    firsts = producer.generate(prompts, [_params(kind, 1, {"do_remote_decode": True, "transfer_id": f"t{i}"})
                                         for i in range(len(prompts))], use_tqdm=False)
    outs = consumer.generate([[*p, f.outputs[0].token_ids[0]] for p, f in zip(prompts, firsts, strict=True)],
                             [_params(kind, NEW - 1, f.kv_transfer_params) for f in firsts], use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.num_cached_tokens == len(p), "the consumer should have loaded the whole prompt"
    return [[f.outputs[0].token_ids[0], *o.outputs[0].token_ids] for f, o in zip(firsts, outs, strict=True)]


def _pair(model: Path, store: KVStoreService, prefill_tp: int, decode_tp: int,
          load_mode: str) -> tuple[Any, Any]:
    return (llm(model, kv_connector="kvstore", kv_role="kv_producer", kv_store_url=store.location,
                tensor_parallel_size=prefill_tp),
            llm(model, kv_connector="kvstore", kv_role="kv_consumer", kv_store_url=store.location,
                kv_load_mode=load_mode, kv_layerwise_max_tokens=300, tensor_parallel_size=decode_tp))


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "load_mode"),
                         [(2, 1, "async"), (1, 2, "layerwise"), (2, 2, "auto")])
def test_a_consumer_of_another_tp_size_reshards_and_equals_colocated(
        store: KVStoreService, long_model_dir: Path, prefill_tp: int, decode_tp: int, load_mode: str) -> None:
    """Greedy: the colocated engine's tokens. Seeded: the tokens of the same split between
    engines of one rank (offline, a consumer's seeded sampling starts its own stream)."""
    prompts = [prompt_of(n) for n in LENGTHS]
    colocated = llm(long_model_dir)
    want = [[*o.outputs[0].token_ids]
            for o in colocated.generate(prompts, _params("greedy", NEW, None), use_tqdm=False)]
    colocated.engine_core.shutdown()
    one = _pair(long_model_dir, store, 1, 1, load_mode)
    seeded = _split(*one, prompts, "seeded")
    for engine in one:
        engine.engine_core.shutdown()
    producer, consumer = _pair(long_model_dir, store, prefill_tp, decode_tp, load_mode)
    try:
        assert _split(producer, consumer, prompts, "greedy") == want
        assert _split(producer, consumer, prompts, "seeded") == seeded
        # the producer's objects: one per rank, under that rank's key (a chunk of the first prompt)
        key = producer.generate([prompts[0]], _params("greedy", 1, {"do_remote_decode": True}),
                                use_tqdm=False)[0].kv_transfer_params["keys"][0]
        with KVStoreClient(store.location) as c:
            found = [c.lookup([f"{rank_key(key, prefill_tp, r)}@2"]) for r in range(prefill_tp)]
            assert found == [1] * prefill_tp
            assert c.lookup([f"{rank_key(key, prefill_tp, prefill_tp)}@2"]) == 0  # no rank past the world
            # every transfer released but the last prefill's: its chunk, 3 layers, each rank's object
            assert c.stats().leased == 3 * prefill_tp
    finally:
        producer.engine_core.shutdown()
        consumer.engine_core.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama_3kv"])
def test_qwen3_a_moe_and_an_uneven_split_across_tp_sizes_equal_transformers(
        store: KVStoreService, tiny_model_dir: Callable[[str], Path], hf_greedy: Any, arch: str) -> None:
    """Qwen3 (q/k norms, head_dim apart from hidden / heads), Qwen3-MoE (tensor-parallel experts)
    and 3 KV heads on 2 ranks (2 + 1: the consumer joins shards of unequal widths),
    P(TP 2) -> D(TP 1) and P(TP 1) -> D(TP 2): the greedy tokens are transformers'."""
    model = tiny_model_dir(arch)
    prompts = [prompt_of(n) for n in (17, 130)]
    want = hf_greedy(model, prompts, NEW)
    for prefill_tp, decode_tp in ((2, 1), (1, 2)):
        producer, consumer = _pair(model, store, prefill_tp, decode_tp, "auto")
        try:
            assert _split(producer, consumer, prompts, "greedy") == want, (prefill_tp, decode_tp)
        finally:
            producer.engine_core.shutdown()
            consumer.engine_core.shutdown()
