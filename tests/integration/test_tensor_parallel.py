"""Tensor parallelism on the CPU (one process a rank, gloo): the engine split over 2 (and 4)
ranks gives, token for token in float32, what it gives on one rank and what transformers gives,
for a dense model (Llama, with fewer KV heads than 4 ranks: replicated), Qwen3 (q/k norms,
head_dim apart from hidden / heads), a mixture of experts (Qwen3-MoE, tensor-parallel experts)
and the default model's head layout (9 query heads in 3 KV groups: 2 + 1 groups on 2 ranks);
greedy and seeded, with penalties, structured outputs, prompt logprobs, prefix caching, chunked
prefill and preemption. A rank that dies stops the engine core (the front end's requests fail with
EngineDeadError) within a bound, and leaves no rank process behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from tests.integration.test_engine_vs_transformers import tiny_prompts

MAX_NEW = 24
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "adult": {"type": "boolean"}},
          "required": ["name", "adult"], "additionalProperties": False}


def _params() -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=MAX_NEW,
                                 ignore_eos=True),
        "penalties": SamplingParams(temperature=0.7, seed=5, presence_penalty=0.8, frequency_penalty=0.5,
                                    repetition_penalty=1.3, max_tokens=MAX_NEW, ignore_eos=True,
                                    logprobs=3, prompt_logprobs=2),
        "json": SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(
            json=json.dumps(SCHEMA), disable_any_whitespace=True)),
    }


LAST_STATS: dict[int, Any] = {}  # tp -> the engine stats at the end of the last _run


def _run(model_dir: Path, tp: int, prompts: list[list[int]], kinds: list[str], **config: Any
         ) -> dict[str, list[Any]]:
    """Each kind's outputs (token ids, and logprobs where asked) from one engine of `tp` ranks."""
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), num_threads=1, max_model_len=256, tensor_parallel_size=tp,
              **{"num_kv_blocks": 96, **config})
    try:
        core = llm.engine_core
        params = _params()
        got: dict[str, list[Any]] = {}
        for kind in kinds:
            outs = llm.generate(prompts, params[kind], use_tqdm=False)
            got[kind] = [(o.outputs[0].token_ids, _logprobs(o)) for o in outs]
        stats = LAST_STATS[tp] = core.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks or config.get("enable_prefix_caching", True)
        return got
    finally:
        llm.engine_core.shutdown()


def _logprobs(out: Any) -> Any:
    lp = out.outputs[0].logprobs
    if lp is None:
        return None
    return [sorted((t, v.logprob, v.rank) for t, v in step.items()) for step in lp]


def assert_same(two: dict[str, list[Any]], one: dict[str, list[Any]]) -> None:
    """The same tokens, and the same logprobs up to float32 sums in another order (the row-parallel
    sums add the ranks' parts): values within 1e-4, the top ranks equal; a sampled token far down
    a tiny random model's nearly flat distribution may swap rank with a near tie (17384 vs 17383)."""
    assert two.keys() == one.keys()
    for kind in one:
        assert [t for t, _ in two[kind]] == [t for t, _ in one[kind]], kind
        for (_, a), (_, b) in zip(two[kind], one[kind], strict=True):
            assert (a is None) == (b is None)
            for step_a, step_b in zip(a or [], b or [], strict=True):
                assert [t for t, _, _ in step_a] == [t for t, _, _ in step_b]
                for (_, va, ra), (_, vb, rb) in zip(step_a, step_b, strict=True):
                    assert abs(va - vb) < 1e-4 and (ra == rb if rb <= 10 else abs(ra - rb) <= rb // 1000 + 1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return tiny_prompts()[:6]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "llama_3kv"])
def test_two_ranks_equal_one_and_transformers(arch: str, tiny_model_dir: Callable[[str], Path],
                                              hf_greedy: Any, prompts: list[list[int]]) -> None:
    model_dir = tiny_model_dir(arch)
    kinds = ["greedy", "seeded"]
    one = _run(model_dir, 1, prompts, kinds)
    two = _run(model_dir, 2, prompts, kinds)
    assert [t for t, _ in two["greedy"]] == hf_greedy(model_dir, prompts, MAX_NEW)
    assert_same(two, one)


def test_penalties_grammars_and_logprobs_are_unchanged_by_two_ranks(
        tiny_model_dir: Callable[[str], Path], prompts: list[list[int]]) -> None:
    model_dir = tiny_model_dir("llama")
    kinds = ["penalties", "json"]
    one, two = (_run(model_dir, tp, prompts, kinds) for tp in (1, 2))
    assert_same(two, one)
    for ids, _ in two["json"]:
        from engine.model.loader import load_tokenizer

        text = load_tokenizer(str(model_dir)).decode(ids, skip_special_tokens=True)
        assert set(json.loads(text)) == {"name", "adult"}


@pytest.mark.parametrize("mode", ["chunked-prefix", "preempt"])
def test_scheduling_modes_are_unchanged_by_two_ranks(mode: str, tiny_model_dir: Callable[[str], Path],
                                                      hf_greedy: Any, prompts: list[list[int]]) -> None:
    """Chunked prefill and a prefix-cache hit (the second pass), and preemption (a cache too small
    for the batch: requests are preempted and recomputed), on two ranks as on one."""
    model_dir = tiny_model_dir("llama")
    config = ({"max_num_batched_tokens": 32} if mode == "chunked-prefix"
              else {"num_kv_blocks": 17, "enable_prefix_caching": False})
    kinds = ["greedy", "greedy"] if mode == "chunked-prefix" else ["greedy", "seeded"]
    two = _run(model_dir, 2, prompts, list(dict.fromkeys(kinds)), **config)
    one = _run(model_dir, 1, prompts, list(dict.fromkeys(kinds)), **config)
    assert_same(two, one)
    assert [t for t, _ in two["greedy"]] == hf_greedy(model_dir, prompts, MAX_NEW)


def test_four_ranks_replicate_the_kv_heads(tiny_model_dir: Callable[[str], Path], hf_greedy: Any,
                                           prompts: list[list[int]]) -> None:
    """Llama's 2 KV heads on 4 ranks: each KV head on two ranks."""
    model_dir = tiny_model_dir("llama")
    four = _run(model_dir, 4, prompts[:3], ["greedy"])
    assert [t for t, _ in four["greedy"]] == hf_greedy(model_dir, prompts[:3], MAX_NEW)


def test_a_model_the_ranks_cannot_split_is_refused_naming_the_setting(
        tiny_model_dir: Callable[[str], Path]) -> None:
    from engine.llm import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size: 3 ranks for the model's 2 KV heads"):
        LLM(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=256, num_kv_blocks=32,
            tensor_parallel_size=3)
    assert not _rank_processes(psutil.Process())


def _rank_processes(parent: psutil.Process) -> list[psutil.Process]:
    """The rank processes under `parent` (spawned by multiprocessing; not its resource tracker)."""
    return [p for p in parent.children(recursive=True) if _alive(p) and "spawn_main" in _cmdline(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


async def test_a_killed_rank_fails_the_engine_in_flight_within_a_bound(
        tiny_model_dir: Callable[[str], Path]) -> None:
    """A core of 2 ranks in its own process; rank 1 is killed while a request runs: the request
    ends with EngineDeadError within 5 s, and no rank process is left."""
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.core_client import EngineDeadError

    config = EngineConfig(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=256,
                          num_kv_blocks=96, tensor_parallel_size=2)
    llm = AsyncLLM(config)
    try:
        core = psutil.Process(llm.engine_core.proc.pid)  # type: ignore[attr-defined]
        ranks = _rank_processes(core)
        assert len(ranks) == 1
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for out in llm.generate([100, 200, 300], params, "r1"):
                seen = len(out.outputs[0].token_ids)
                if seen == 5:
                    for rank in ranks:
                        rank.kill()

        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(consume(), timeout=30)
        assert time.monotonic() - start < 10 and seen >= 5
        core.wait(timeout=10)  # the core process exits
        assert not [p for p in ranks if _alive(p)]
    finally:
        llm.shutdown()


def test_speculative_decoding_on_two_ranks_is_unchanged(tiny_model_dir: Callable[[str], Path],
                                                       prompts: list[list[int]]) -> None:
    """Drafts reach every rank in the step message and the emitted tokens with the next: two
    ranks verifying n-gram drafts give one rank's plain output (the model loops, so drafts are
    accepted), grammars included."""
    model_dir = tiny_model_dir("llama")
    kinds = ["greedy", "seeded", "json"]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    two = _run(model_dir, 2, prompts, kinds, speculative_config=spec)
    assert LAST_STATS[2].spec_decoding.num_accepted_tokens > 0
    one = _run(model_dir, 1, prompts, kinds)
    assert_same(two, one)
