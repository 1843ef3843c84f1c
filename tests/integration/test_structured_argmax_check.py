"""Constrained rows checked before any mask (the CPU engine's default, ArgmaxCheck): greedy rows,
and sampled rows without top-k / top-p / min-p, give the same tokens, logprobs, finish reasons
and errors as masking every row first, for every sampling parameter they can carry, beside rows
that are always masked (logprobs, top-k, top-p, min-p) in one batch (llguidance's rows are
always masked first); and both ways of a check (the grammar allows the unmasked choice: no mask;
it refuses it: that row alone is filled) really happen, greedy and sampled.

What the check claims is exact for the same logits; it says nothing of logits computed in other
batches. The forward is not batch-invariant bit for bit on a CPU: oneDNN's GEMM blocks by the
number of rows, so a token's logits in a batch of 14 differ in the last bits from the same
token's in a batch of 56 (on AVX-512 here; on another ISA other shapes). So each compared run
must schedule the same batches (`one_schedule`): an empty prefix cache (a second run of the
same prompts would otherwise skip their cached blocks), and every grammar admitted in the first
step (a cold run would otherwise admit each request as its grammar compiles). Before this, the
first run compiled while stepping and the second found every grammar and prompt cached; the
always-masked T=1 logprobs row then differed by an ulp and sampled other tokens downstream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import wait
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.manager import GrammarState
from engine.structured.params import StructuredOutputsParams as SOP
from tests.integration.test_structured_engine import SPECS, prompts, valid

EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> Iterator[LLM]:
    engine = LLM(model=str(tiny_model_dir("llama")), num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def one_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waits for its grammar when the scheduler first asks, so every request of a run
    joins the first step: the batches no longer depend on how fast the grammar threads are."""

    def ready(state: GrammarState) -> bool:
        wait([state.future])
        return True

    monkeypatch.setattr(GrammarState, "ready", property(ready))


def checked_and_other_rows(llm: LLM) -> list[SamplingParams]:
    tok = llm.tokenizer
    a, b, c, one = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "1"))
    return [
        # checked unmasked: greedy, no logprobs
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=1.0,
                       presence_penalty=1.5),
        SamplingParams(temperature=0.0, logit_bias={a: 30.0, one: 25.0, EOS: 20.0, b: -100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[a, b, c, one, EOS, 11, 500, 4000]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[a]], logit_bias={a: 30.0, c: 20.0}),
        SamplingParams(temperature=0.0, min_tokens=3, logit_bias={EOS: 50.0}),
        # checked unmasked: sampled (seeded) without top-k, top-p, min-p, no logprobs
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.2, presence_penalty=0.5,
                       logit_bias={a: 8.0, one: 6.0, EOS: 4.0}),
        SamplingParams(temperature=1.5, seed=6, allowed_token_ids=[a, b, c, one, EOS, 11, 500],
                       min_tokens=2, top_k=-1, top_p=1.0),
        # always masked first
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, seed=4, top_k=5, logprobs=1),
        SamplingParams(temperature=1.0, seed=7, top_p=0.9),
        SamplingParams(temperature=1.0, seed=8, min_p=0.1),
        SamplingParams(temperature=1.0, seed=9, logprobs=0),
    ]


def run(llm: LLM, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """Generates from an empty prefix cache (with `one_schedule`: the same batches every run)."""
    assert llm.engine_core.reset_prefix_cache()
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, str(o.outputs[0].stop_reason),
             [{t: lp.logprob for t, lp in e.items()} for e in (o.outputs[0].logprobs or [])])
            for o in outs]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_checked_rows_equal_rows_masked_first(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                                              backend: str) -> None:
    core = llm.engine_core
    counts = core.structured.check_counts
    kinds = checked_and_other_rows(llm)
    specs = [replace(s, backend=backend) for s in SPECS.values()]
    params = [replace(k, max_tokens=40, structured_outputs=s) for s in specs for k in kinds]
    p = prompts(len(params), seed=29)
    assert core.check_unmasked  # the CPU engine's default
    checked, refused = counts.checked, counts.refused
    unmasked = run(llm, p, params)
    checked, refused = counts.checked - checked, counts.refused - refused
    if backend == "xgrammar":
        assert checked > 0 and 0 < refused < checked  # both ways of the check ran
    else:
        assert checked == 0  # llguidance rows are always masked first (see XgrammarMatcher.allows)
    monkeypatch.setattr(core, "check_unmasked", False)
    before = counts.checked
    masked = run(llm, p, params)
    assert counts.checked == before  # every row was masked first this time
    for i, (got, want) in enumerate(zip(unmasked, masked, strict=True)):
        assert got == want, (params[i].structured_outputs, params[i])
    ended = [(o, sp.structured_outputs) for o, sp in zip(unmasked, params, strict=True)
             if o[1] == "stop"]
    assert len(ended) > len(params) // 2
    for (token_ids, _, _, _), spec in ended:
        assert spec is not None
        if spec.regex is None:  # (llguidance's \d takes digits of a newer Unicode than re's)
            assert valid(spec, llm.tokenizer.decode(token_ids, skip_special_tokens=True))


def test_sampled_rows_are_checked_both_ways(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled rows alone: the check lets some choices through and refuses others, and the
    tokens equal masking first."""
    counts = llm.engine_core.structured.check_counts
    checked, refused = counts.checked, counts.refused
    a = llm.tokenizer.convert_tokens_to_ids("a")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, logit_bias={a: 12.0},
                             top_k=llm.engine_core.vocab_size if s % 2 else -1,  # both "off"
                             structured_outputs=SPECS["regex"]) for s in range(4)]
    p = prompts(4, seed=41)
    assert llm.engine_core.reset_prefix_cache()
    outs = llm.generate(p, params, use_tqdm=False)
    assert all(valid(SPECS["regex"], o.outputs[0].text) for o in outs)
    checked, refused = counts.checked - checked, counts.refused - refused
    assert checked >= sum(len(o.outputs[0].token_ids) for o in outs) and 0 < refused < checked
    monkeypatch.setattr(llm.engine_core, "check_unmasked", False)
    assert llm.engine_core.reset_prefix_cache()
    masked = llm.generate(p, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in masked] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_row_left_with_nothing_fails_the_same_way(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                                                    temperature: float) -> None:
    """min_tokens past the grammar's end: the check refuses the unmasked choice, the mask leaves
    nothing, and the request ends with the error that says why, as when masked first."""
    spec = SOP(choice=["red", "green"])
    params = [SamplingParams(temperature=temperature, seed=1, max_tokens=20, min_tokens=9,
                             structured_outputs=spec)]
    p = prompts(1, seed=31)
    counts = llm.engine_core.structured.check_counts
    refused = counts.refused
    unmasked = run(llm, p, params)
    assert counts.refused > refused  # the check ran and refused
    monkeypatch.setattr(llm.engine_core, "check_unmasked", False)
    assert run(llm, p, params) == unmasked
    assert unmasked[0][1] == "abort" and "min_tokens=9 forbids the stop token" in unmasked[0][2]

