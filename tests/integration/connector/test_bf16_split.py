"""bfloat16 through the split: a bf16 producer saves bf16 KV (LMCache's "bfloat16" in every key
and in each object's metadata), a bf16 consumer loads it (async and layer-wise) and gives the
tokens a colocated bf16 engine gives; and bf16 stays close to the float32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.lmcache_format import RemoteMetadata
from kvstore.lmcache_format.keys import parse_key
from kvstore.service import KVStoreService
from tests.integration.connector.test_disaggregated import LENGTHS, decode, greedy, llm, prefill, prompt_of

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def colocated_bf16(long_model_dir: Path) -> dict[int, list[int]]:
    engine = llm(long_model_dir, dtype="bfloat16")
    assert engine.engine_core.runner.kv_caches[0].dtype == torch.bfloat16
    outs = engine.generate([prompt_of(n) for n in LENGTHS], greedy(NEW_TOKENS), use_tqdm=False)
    engine.engine_core.shutdown()
    return {n: list(o.outputs[0].token_ids) for n, o in zip(LENGTHS, outs, strict=True)}


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_bf16_split_equals_bf16_colocated(store: KVStoreService, long_model_dir: Path,
                                          colocated_bf16: dict[int, list[int]], load_mode: str) -> None:
    producer = llm(long_model_dir, dtype="bfloat16", kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, dtype="bfloat16", kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_load_mode=load_mode)
    prompts = [prompt_of(n) for n in LENGTHS]
    firsts = prefill(producer, prompts)
    outs = decode(consumer, prompts, firsts)
    for n, (tok, _), o in zip(LENGTHS, firsts, outs, strict=True):
        assert [tok, *o.outputs[0].token_ids] == colocated_bf16[n], f"prompt of {n} tokens differs"
        assert o.num_cached_tokens == n
    keys = [k for _, params in firsts for k in params["keys"]]
    assert keys and all(parse_key(k).dtype == "bfloat16" for k in keys)
    with KVStoreClient(store.location) as c:
        objects = [o for o in c.get([f"{k}@{layer}" for k in keys[:4] for layer in (0, 2)])
                   if o is not None]  # one object per chunk and layer
    assert objects, "the producer's chunks should be in the store"
    for obj in objects:
        assert RemoteMetadata.unpack(obj.metadata).dtypes[0] == "bfloat16"
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


def test_bf16_logits_stay_close_to_float32(long_model_dir: Path) -> None:
    """The same prompts' prompt logprobs in both dtypes: bf16's error is that of its 8-bit
    mantissa, not a wrong computation."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompts = [prompt_of(n, seed=7) for n in (40, 300)]
    got = {}
    for dtype in ("float32", "bfloat16"):
        engine = llm(long_model_dir, dtype=dtype)
        outs = engine.generate(prompts, params, use_tqdm=False)
        got[dtype] = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
        engine.engine_core.shutdown()
    for full, half in zip(got["float32"], got["bfloat16"], strict=True):
        err = (torch.tensor(full) - torch.tensor(half)).abs()
        assert float(err.max()) < 0.1 and float(err.mean()) < 0.02, (float(err.max()), float(err.mean()))
