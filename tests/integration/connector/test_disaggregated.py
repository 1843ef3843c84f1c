"""Disaggregated prefill/decode through a real KV store server: a producer engine prefills,
a consumer engine loads the KV and decodes; greedy float32 tokens equal one colocated engine.
Faults (store unreachable, evicted objects, a corrupted layer) recompute to the same tokens or
fail clearly by policy; no block leaks and no lease left behind."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.sampling_params import SamplingParams
from kvstore.client import KVStoreClient
from kvstore.service import KVStoreService

NEW_TOKENS = 8
LENGTHS = [1, 15, 16, 17, 255, 256, 257, 1000]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 100_003 + n)
    return [rng.randrange(100, 49000) for _ in range(n)]


def llm(model: Path, **kw: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=str(model), num_threads=1, kv_cache_gib=0.05, **kw)


def greedy(n: int, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=params)


@pytest.fixture(scope="module")
def colocated(long_model_dir: Path) -> dict[int, list[int]]:
    engine = llm(long_model_dir)
    outs = engine.generate([prompt_of(n) for n in LENGTHS], greedy(NEW_TOKENS), use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(LENGTHS, outs, strict=True)}


def prefill(producer: Any, prompts: list[list[int]]) -> list[tuple[int, dict[str, Any]]]:
    outs = producer.generate(prompts, [greedy(1, {"do_remote_decode": True, "transfer_id": f"t{i}"})
                                       for i in range(len(prompts))], use_tqdm=False)
    result = []
    for o in outs:
        params = o.kv_transfer_params
        assert params is not None and params["do_remote_prefill"]
        result.append((o.outputs[0].token_ids[0], params))
    return result


def decode(consumer: Any, prompts: list[list[int]], firsts: list[tuple[int, dict[str, Any]]]
           ) -> list[Any]:
    return consumer.generate([[*p, tok] for p, (tok, _) in zip(prompts, firsts, strict=True)],
                             [greedy(NEW_TOKENS - 1, params) for _, params in firsts], use_tqdm=False)


def free_blocks(engine: Any) -> tuple[int, int]:
    stats = engine.engine_core.get_stats()
    return stats.num_free_blocks, stats.num_total_blocks


@pytest.mark.parametrize("load_mode", ["async", "layerwise", "auto"])
@pytest.mark.parametrize("prefill_mode", ["whole", "chunked-prefill", "sjf-chunked"])
def test_disaggregated_equals_colocated(store: KVStoreService, long_model_dir: Path,
                                        colocated: dict[int, list[int]], prefill_mode: str,
                                        load_mode: str) -> None:
    """"auto" with a 300-token bound loads the short prompts layer-wise and the long ones
    async, in the same steps. "sjf-chunked": the producer runs the prefill workers' policy
    (shortest first, long prefills paused for shorter ones between chunks)."""
    extra: dict[str, Any] = {
        "whole": {}, "chunked-prefill": {"max_num_batched_tokens": 64},
        "sjf-chunked": {"max_num_batched_tokens": 64, "scheduling_policy": "sjf"}}[prefill_mode]
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location, **extra)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location, kv_load_mode=load_mode,
                   kv_layerwise_max_tokens=300)
    prompts = [prompt_of(n) for n in LENGTHS]
    firsts = prefill(producer, prompts)
    outs = decode(consumer, prompts, firsts)
    for n, (tok, _), o in zip(LENGTHS, firsts, outs, strict=True):
        assert [tok, *o.outputs[0].token_ids] == colocated[n], f"prompt of {n} tokens differs"
        assert o.num_cached_tokens == n, "the consumer should have loaded the whole prompt"
    for engine in (producer, consumer):
        free, total = free_blocks(engine)
        assert free == total
    with KVStoreClient(store.location) as c:
        assert c.stats().leased == 0  # the consumer acknowledged every transfer
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


def test_prefix_computed_once_is_reused_by_another_engine(store: KVStoreService,
                                                          long_model_dir: Path,
                                                          colocated: dict[int, list[int]]) -> None:
    """Cross-instance reuse: no transfer params; the second engine finds the chunks by hash."""
    first = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_both", kv_store_url=store.location)
    second = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_both", kv_store_url=store.location)
    prompt = prompt_of(1000)
    first.generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)
    out = second.generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == colocated[1000]
    assert out.num_cached_tokens == 999  # every chunk, the last partial one too (same tokens)
    # A longer prompt sharing the first 1,000 tokens reuses the three full 256-token chunks.
    longer = prompt + prompt_of(40, seed=9)
    want = llm(long_model_dir).generate([longer], greedy(NEW_TOKENS), use_tqdm=False)[0]
    out = second.generate([longer], greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert out.num_cached_tokens >= 768
    first.engine_core.shutdown()
    second.engine_core.shutdown()


def _corrupt_layer(store: KVStoreService, key: str) -> None:
    from kvstore.lmcache_format import MemoryFormat, RemoteMetadata

    bad = torch.zeros(3, 2, 32)
    meta = RemoteMetadata.single(tuple(bad.shape), bad.dtype, MemoryFormat.KV_T2D).pack()
    with KVStoreClient(store.location) as c:
        c.put([(key, meta, bad.numpy())])


FAULTS = ["unreachable", "evicted", "missing-layer", "corrupted"]


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("fault", FAULTS)
def test_faults_recompute_to_the_same_tokens_or_fail_clearly(
        store: KVStoreService, long_model_dir: Path, colocated: dict[int, list[int]],
        fault: str, policy: str, load_mode: str) -> None:
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    url = "grpc://127.0.0.1:9" if fault == "unreachable" else store.location
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=url, kv_load_failure_policy=policy, kv_load_mode=load_mode)
    lengths = [17, 257]
    prompts = [prompt_of(n) for n in lengths]
    firsts = prefill(producer, prompts)
    with KVStoreClient(store.location) as c:
        keys = [k for _, p in firsts for k in p["keys"]]
        if fault == "evicted":
            c.delete([f"{k}@{layer}" for k in keys for layer in range(3)])
        elif fault == "missing-layer":
            c.delete([f"{k}@1" for k in keys])
        elif fault == "corrupted":
            for k in keys:
                _corrupt_layer(store, f"{k}@2")
    outs = decode(consumer, prompts, firsts)
    for n, (tok, _), o in zip(lengths, firsts, outs, strict=True):
        sample = o.outputs[0]
        if policy == "recompute":
            assert [tok, *sample.token_ids] == colocated[n]
        else:
            assert sample.finish_reason == "abort"
            assert "kv_load_failed" in str(sample.stop_reason)
    for engine in (producer, consumer):
        free, total = free_blocks(engine)
        assert free == total
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()


CONSUMER_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from engine.llm import LLM
from engine.sampling_params import SamplingParams
job = json.load(open({job!r}))
engine = LLM(model=job["model"], num_threads=1, kv_cache_gib=0.05, kv_connector="kvstore",
             kv_role="kv_consumer", kv_store_url=job["url"])
params = [SamplingParams(temperature=0.0, max_tokens=job["n"], ignore_eos=True, kv_transfer_params=p)
          for p in job["params"]]
outs = engine.generate(job["prompts"], params, use_tqdm=False)
stats = engine.engine_core.get_stats()
print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens for o in outs],
                   "leak": stats.num_total_blocks - stats.num_free_blocks}}))
"""


def test_producer_and_consumer_in_separate_processes(store: KVStoreService, long_model_dir: Path,
                                                     colocated: dict[int, list[int]],
                                                     tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[3])
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    lengths = [16, 257, 1000]
    prompts = [prompt_of(n) for n in lengths]
    firsts = prefill(producer, prompts)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": str(long_model_dir), "url": store.location, "n": NEW_TOKENS - 1,
                               "prompts": [[*p, t] for p, (t, _) in zip(prompts, firsts, strict=True)],
                               "params": [p for _, p in firsts]}))
    script = CONSUMER_SCRIPT.format(root=root, job=str(job))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for n, (tok, _), got, cached in zip(lengths, firsts, result["tokens"], result["cached"], strict=True):
        assert [tok, *got] == colocated[n]
        assert cached == n
    assert result["leak"] == 0
    producer.engine_core.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "multiprocess"])
def test_sixteen_staggered_requests_some_waiting_for_kv_while_others_decode(
        store: KVStoreService, long_model_dir: Path, multiprocess: bool) -> None:
    import asyncio

    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig

    lengths = [17 + 37 * i for i in range(16)]
    prompts = [prompt_of(n, seed=3) for n in lengths]
    expected = [list(o.outputs[0].token_ids) for o in llm(long_model_dir).generate(
        prompts, greedy(12), use_tqdm=False)]
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    firsts = prefill(producer, prompts)

    async def one(engine: AsyncLLM, i: int) -> list[int]:
        await asyncio.sleep(0.01 * (i % 5))
        tok, params = firsts[i]
        final = None
        async for out in engine.generate(prompts[i] + [tok], greedy(11, params), request_id=f"d{i}"):
            final = out
        assert final is not None
        return [tok, *final.outputs[0].token_ids]

    async def main() -> list[list[int]]:
        engine = AsyncLLM(EngineConfig(model=str(long_model_dir), num_threads=1, kv_cache_gib=0.05,
                                       kv_connector="kvstore", kv_role="kv_consumer",
                                       kv_store_url=store.location), multiprocess=multiprocess)
        try:
            return list(await asyncio.wait_for(
                asyncio.gather(*(one(engine, i) for i in range(16))), timeout=240))
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == expected
    producer.engine_core.shutdown()


def test_prefix_cache_hits_on_both_sides(store: KVStoreService, long_model_dir: Path,
                                         colocated: dict[int, list[int]]) -> None:
    """The same prompts go through twice: the second time both engines hit their own prefix
    caches (the consumer loads only what it lacks) and the tokens stay the same."""
    producer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_producer",
                   kv_store_url=store.location)
    consumer = llm(long_model_dir, kv_connector="kvstore", kv_role="kv_consumer",
                   kv_store_url=store.location)
    lengths = [17, 257]
    prompts = [prompt_of(n) for n in lengths]
    for _ in range(2):
        firsts = prefill(producer, prompts)
        outs = decode(consumer, prompts, firsts)
        for n, (tok, _), o in zip(lengths, firsts, outs, strict=True):
            assert [tok, *o.outputs[0].token_ids] == colocated[n]
    assert producer.engine_core.get_stats().prefix_cache_hits > 0
    assert consumer.engine_core.get_stats().prefix_cache_hits > 0
    for engine in (producer, consumer):
        free, total = free_blocks(engine)
        assert free == total
    producer.engine_core.shutdown()
    consumer.engine_core.shutdown()
