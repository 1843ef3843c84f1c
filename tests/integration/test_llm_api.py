"""The offline `LLM` API: prompt handling, ordering, n, chat, stop strings, logprobs, bad input.

References: transformers greedy generation (conftest `hf_greedy`), transformers log-softmax,
and the tokenizer's own decode / chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.sampling_params import SamplingParams

PROMPTS = [[200 + 11 * i + j for j in range(5 + 4 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]):
    from engine.llm import LLM

    return LLM(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=128,
               num_kv_blocks=96)


def assert_no_leak(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_greedy_outputs_match_transformers_in_prompt_order(llm, tiny_model_dir, hf_greedy):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(
        tiny_model_dir("llama"), PROMPTS, 12)
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.finished and o.prompt is None
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == "length"
    assert_no_leak(llm)


def test_single_text_and_token_prompts_are_accepted(llm):
    tok = llm.get_tokenizer()
    (by_text,) = llm.generate("Hello there", GREEDY, use_tqdm=False)
    (by_ids,) = llm.generate(tok("Hello there").input_ids, GREEDY, use_tqdm=False)
    assert by_text.prompt == "Hello there"
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_per_prompt_sampling_params_apply_to_their_prompt(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (3, 7, 1)]
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 1]
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(PROMPTS[:3], params[:2], use_tqdm=False)


def test_n_samples_are_returned_together(llm):
    (greedy,) = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=0.0, max_tokens=6,
                                                          ignore_eos=True), use_tqdm=False)
    assert [o.index for o in greedy.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], sampled, use_tqdm=False)[0]
    again = llm.generate([PROMPTS[1]], sampled, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert_no_leak(llm)


def test_chat_renders_the_template(llm):
    messages = [{"role": "user", "content": "Say hi"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out.prompt == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    two = llm.chat([messages, messages], SamplingParams(temperature=0.0, max_tokens=4),
                   use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_stop_string_ends_the_request_and_frees_its_blocks(llm):
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    (full,) = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)
    text = full.outputs[0].text
    words = text.split()
    assert len(words) > 4, f"need visible words in {text!r}"
    stop = words[len(words) // 2][:4]
    for include in (False, True):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                                stop=[stop], include_stop_str_in_output=include)
        (cut,) = llm.generate([PROMPTS[2]], params, use_tqdm=False)
        out = cut.outputs[0]
        end = text.index(stop) + (len(stop) if include else 0)
        assert out.text == text[:end]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert len(out.token_ids) < 20
        assert out.token_ids == full.outputs[0].token_ids[: len(out.token_ids)]
        assert_no_leak(llm)


def test_logprobs_match_transformers_log_softmax(llm, tiny_model_dir):
    import transformers

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    sample = out.outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"),
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + list(sample.token_ids)])
    with torch.inference_mode():
        logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)  # [seq, vocab]
    assert sample.logprobs is not None and len(sample.logprobs) == 4
    total = 0.0
    for i, (tid, position) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        ref = logp[len(PROMPTS[0]) - 1 + i]
        assert position[tid].rank == 1
        assert position[tid].logprob == pytest.approx(ref[tid].item(), abs=1e-3)
        top = torch.topk(ref, 3).indices.tolist()
        assert set(top) <= set(position)
        total += ref[tid].item()
    assert sample.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_cache_salt_separates_prefix_cache_hits_but_never_changes_tokens(llm):
    prompt = [300 + (7 * i) % 97 for i in range(40)]  # two full blocks of 16 and a tail

    def run(salt: str | None) -> tuple[list[int], int]:
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt,
                                                                "cache_salt": salt}
        (out,) = llm.generate(p, GREEDY, use_tqdm=False)
        return list(out.outputs[0].token_ids), out.num_cached_tokens or 0

    llm.engine_core.reset_prefix_cache()
    plain, _ = run(None)
    runs = {salt: run(salt) for salt in ("tenant-a", "tenant-b")}
    assert {tokens == plain for tokens, _ in runs.values()} == {True}  # caching only, not tokens
    assert [hit for _, hit in runs.values()] == [0, 0]  # neither hits the unsalted or each other
    assert run("tenant-a") == (plain, 32)  # a repeat with the same salt hits its own blocks
    assert run(None) == (plain, 32)  # and the unsalted prompt still hits its own
    assert_no_leak(llm)


@pytest.mark.parametrize(("prompts", "message"), [
    ([PROMPTS[0], []], "prompt must not be empty"),
    ([PROMPTS[0], [1] * 200], "longer than max_model_len=128"),
    ([PROMPTS[0], [10**6]], "out of range"),
    ([], "prompts must be"),
    ([{"prompt_token_ids": PROMPTS[0], "cache_salt": ""}], "cache_salt must be a non-empty string"),
    ([{"prompt_token_ids": PROMPTS[0], "salt": "x"}], "unknown keys"),
])
def test_bad_input_raises_before_anything_is_queued(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    (ok,) = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 12


def test_default_model_matches_transformers_greedy(default_model_dir, hf_greedy):
    from engine.llm import LLM

    llm = LLM(num_threads=2, max_model_len=256, num_kv_blocks=32)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                      use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(default_model_dir,
                                                       [out.prompt_token_ids], 8)[0]
    assert "Paris" in out.outputs[0].text
