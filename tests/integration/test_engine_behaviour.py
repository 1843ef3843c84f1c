"""Sampling, stopping and bad-input behaviour of the whole engine, as vLLM users expect it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams

PROMPTS = [[100 + i * 7 + j for j in range(10 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]):  # type: ignore[no-untyped-def]
    from engine.llm import LLM

    return LLM(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=256)


def tokens(outs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leak(llm) -> None:  # type: ignore[no-untyped-def]
    stats = llm.engine_core.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(llm) -> None:  # type: ignore[no-untyped-def]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=24)
    alone = tokens(llm.generate([PROMPTS[2]], seeded, use_tqdm=False))[0]
    again = tokens(llm.generate([PROMPTS[2]], seeded, use_tqdm=False))[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]],
                         [unseeded, seeded, unseeded], use_tqdm=False)
    reordered = llm.generate([PROMPTS[4], PROMPTS[5], PROMPTS[2]],
                             [unseeded, unseeded, seeded], use_tqdm=False)
    assert alone == again == tokens(mixed)[1] == tokens(reordered)[2]
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=124, max_tokens=24)
    assert tokens(llm.generate([PROMPTS[2]], other_seed, use_tqdm=False))[0] != alone
    assert_no_leak(llm)


def test_n_samples_with_a_seed_differ_from_each_other_but_repeat_across_runs(llm) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16)
    a = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    samples = [list(c.token_ids) for c in a.outputs]
    assert samples == [list(c.token_ids) for c in b.outputs]
    assert len({tuple(s) for s in samples}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_max_tokens_caps_the_output_with_finish_reason_length(llm) -> None:  # type: ignore[no-untyped-def]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=7,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_end_the_request_and_are_kept_as_last_token(llm) -> None:  # type: ignore[no-untyped-def]
    free_run = tokens(llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=20,
                                                                ignore_eos=True),
                                   use_tqdm=False))[0]
    stop_id = free_run[5]
    first = free_run.index(stop_id)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=20,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == free_run[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # min_tokens holds the stop token back until enough tokens exist.
    held = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=20,
                                                     stop_token_ids=[stop_id],
                                                     min_tokens=first + 2), use_tqdm=False)[0]
    assert len(held.outputs[0].token_ids) >= first + 2


def test_stop_strings_cut_the_text_and_end_the_request(llm) -> None:  # type: ignore[no-untyped-def]
    base = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("random model produced whitespace around the middle")
    cut = text.index(stop)
    out = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == text[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < 24
    kept = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert kept.outputs[0].text == text[:cut + len(stop)]
    assert_no_leak(llm)


def test_eos_ends_generation_unless_ignored(llm) -> None:  # type: ignore[no-untyped-def]
    free_run = tokens(llm.generate([PROMPTS[5]], SamplingParams(temperature=0.0, max_tokens=12,
                                                                ignore_eos=True),
                                   use_tqdm=False))[0]
    # The tiny model's EOS id is 2: without ignore_eos the run ends at its first EOS, if any.
    out = llm.generate([PROMPTS[5]], SamplingParams(temperature=0.0, max_tokens=12),
                       use_tqdm=False)[0]
    if 2 in free_run:
        assert list(out.outputs[0].token_ids) == free_run[:free_run.index(2) + 1]
    else:
        assert list(out.outputs[0].token_ids) == free_run


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_the_engine_keeps_serving(llm) -> None:  # type: ignore[no-untyped-def]
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[100] * 300], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], ok, use_tqdm=False)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], ok, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    assert_no_leak(llm)


def test_unknown_model_is_a_clear_error() -> None:
    from engine.llm import LLM

    with pytest.raises(ValueError, match="model"):
        LLM(model="no-such-model-anywhere-xyz")
