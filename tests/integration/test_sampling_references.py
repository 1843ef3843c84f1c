"""Sampling parameters against independent references, and seeded draws that do not depend on
how the engine ran (issue 18).

- logit_bias, allowed_token_ids, bad_words, min_tokens and the repetition penalty: the engine's
  greedy float32 output equals transformers `generate` with transformers' own logits processors
  (SequenceBias, PrefixConstrained, NoBadWords, MinNewTokensLength, RepetitionPenalty); presence
  and frequency penalties, which transformers lacks, against a plain processor written here
  from OpenAI's definition.
- A seeded, penalized request gives the same tokens alone, in a batch, chunked, and preempted
  mid-decode (its draws are a function of (seed, output position) only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.sampling_params import SamplingParams

PROMPTS = [[311, 5021, 77, 1203, 9], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58],
           [8000, 12, 12, 12, 900]]
NEW = 32


class _PresenceFrequency:
    """OpenAI's presence / frequency penalties over the generated tokens (a reference)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for row in range(scores.shape[0]):
            for tok in set(input_ids[row, self.prompt_len:].tolist()):
                count = int((input_ids[row, self.prompt_len:] == tok).sum())
                out[row, tok] -= self.presence + self.frequency * count
        return out


def _hf_processors(case: dict[str, Any], prompt_len: int, vocab: int) -> list[Any]:
    """transformers' processors in the engine's order: allowed, bad words, min tokens, bias,
    then the penalties (repetition, then frequency and presence)."""
    import transformers as tf

    procs: list[Any] = []
    if "allowed_token_ids" in case:
        allowed = list(case["allowed_token_ids"])
        procs.append(tf.PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, num_beams=1))
    if "bad_words_token_ids" in case:
        procs.append(tf.NoBadWordsLogitsProcessor(case["bad_words_token_ids"], eos_token_id=None))
    if "min_tokens" in case:
        procs.append(tf.MinNewTokensLengthLogitsProcessor(prompt_len, case["min_tokens"],
                                                          case["stop_token_ids"]))
    if "logit_bias" in case:
        procs.append(tf.SequenceBiasLogitsProcessor(
            sequence_bias=[[[t], b] for t, b in case["logit_bias"].items()]))
    if "repetition_penalty" in case:
        procs.append(tf.RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if "presence_penalty" in case or "frequency_penalty" in case:
        procs.append(_PresenceFrequency(prompt_len, case.get("presence_penalty", 0.0),
                                        case.get("frequency_penalty", 0.0)))
    return procs


CASES: dict[str, dict[str, Any]] = {
    "logit_bias": {"logit_bias": {17: 5.0, 900: 4.0, 23: 6.5, 1000: -100.0}},
    "allowed_token_ids": {"allowed_token_ids": [5, 9, 12, 77, 311, 900, 1203, 4444]},
    # bad words whose prefixes do not end any prompt (transformers also looks at the prompt)
    "bad_words": {"bad_words_token_ids": [[9], [58], [44205, 44205], [8, 9, 10]]},
    "min_tokens": {"min_tokens": 20, "stop_token_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11]},
    "repetition": {"repetition_penalty": 1.7},
    "presence_frequency": {"presence_penalty": 1.2, "frequency_penalty": 0.9},
    "all": {"logit_bias": {17: 5.0, 23: 4.0}, "repetition_penalty": 1.3, "presence_penalty": 0.5,
            "frequency_penalty": 0.4, "bad_words_token_ids": [[99]]},
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    from engine.llm import LLM

    with LLM(model=str(model_dir), num_threads=1, max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_with_logit_edits_equals_transformers_processors(llm: Any, hf_model: Any, name: str) -> None:
    import transformers as tf

    case = CASES[name]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **case)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)]
    for prompt, tokens, _before in zip(PROMPTS, got, plain, strict=True):
        ids = torch.tensor([prompt])
        procs = tf.LogitsProcessorList(_hf_processors(case, len(prompt), hf_model.config.vocab_size))
        with torch.inference_mode():
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW, pad_token_id=2, logits_processor=procs)
        assert list(tokens) == want[0, len(prompt):].tolist(), f"{name}: prompt {prompt[:3]}..."
    assert got != plain, f"{name} changed no token: the case tests nothing"


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=40, ignore_eos=True,
                          presence_penalty=0.4, frequency_penalty=0.4, repetition_penalty=1.1,
                          min_tokens=4, logit_bias={17: 2.0}, logprobs=2)


def test_seeded_tokens_are_the_same_alone_batched_chunked_and_preempted(model_dir: Path, llm: Any) -> None:
    from engine.llm import LLM

    prompts = [[(7 * i + 13 * j) % 4000 + 100 for j in range(20 + 12 * i)] for i in range(6)]
    params = [_seeded(i) for i in range(len(prompts))]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params,
                                                                                      strict=True)]
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(model_dir), num_threads=1, max_model_len=256, num_kv_blocks=17,
             max_num_batched_tokens=32, enable_prefix_caching=False) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption was forced"
    squeezed = [o.outputs[0] for o in outs]
    for a, b, c in zip(alone, batched, squeezed, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)
    assert len({tuple(a.token_ids) for a in alone}) == len(prompts)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_log_softmax(model_dir: Path, llm: Any, hf_model: Any,
                                                        chunked: bool) -> None:
    from engine.llm import LLM

    prompts = [list(range(300, 300 + n)) for n in (2, 17, 40)] + PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4)
    if chunked:  # prompt positions come chunk by chunk; a cached prefix is computed again
        with LLM(model=str(model_dir), num_threads=1, max_model_len=256,
                 max_num_batched_tokens=16) as small:
            small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            outs = small.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert entry is not None
            row = ref[pos - 1]  # the logits before token `pos` predict it
            tok = prompt[pos]
            assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
            rank = entry[tok].rank
            assert rank is not None  # ties within float noise may order either way:
            assert int((row > row[tok] + 1e-4).sum()) + 1 <= rank <= int((row > row[tok] - 1e-4).sum()) + 1
            top = {t: lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= 4}
            assert len(top) == 4 or tok in top  # the prompt token may be one of the top 4
            assert sorted(lp.logprob for lp in top.values())[::-1][:4] == pytest.approx(
                row.topk(4).values.tolist()[:len(top)], abs=1e-4)
            for t, lp in top.items():
                assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert out.outputs[0].token_ids  # the request still generates
