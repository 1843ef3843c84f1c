"""Speculative decoding (n-gram drafts) never changes output: each request's tokens, logprobs,
texts and finish reasons with speculation equal those without it, for every sampling parameter
and in batch, chunked-prefill, prefix-hit, preemption, n > 1 and structured-output runs; no
block leaks; unseeded sampling with speculation follows the target distribution.

Prompts repeat a stretch of the tiny model's own greedy continuation, so n-gram drafts are
often right and each test also checks that drafts were accepted (a test whose drafts are all
rejected would prove nothing). Logprobs are compared within 1e-4 (float32: verifying several
positions in one forward changes the GEMM shapes, not the tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

# no per-step draft cap: the distribution test runs 600 requests in one batch, which the default
# cap (32 drafts a step) would leave without drafts
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "max_draft_tokens_per_step": None}
ENGINE = dict(num_threads=1, max_model_len=256, num_kv_blocks=160, dtype="float32")


def _llm(path: Path, **kw: Any) -> Any:
    from engine.llm import LLM

    return LLM(model=str(path), **{**ENGINE, **kw})


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def plain(model: Path) -> Any:
    return _llm(model)


@pytest.fixture(scope="module")
def spec(model: Path) -> Any:
    return _llm(model, speculative_config=SPEC)


@pytest.fixture(scope="module")
def prompts(plain: Any) -> list[list[int]]:
    """Prompts followed by a stretch of their own greedy continuation and the prompt again: the
    model's next tokens are likely to repeat what follows, which n-gram lookup drafts."""
    bases = [[300 + 7 * i + j for j in range(6 + 3 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = plain.generate(bases, greedy, use_tqdm=False)
    return [b + list(o.outputs[0].token_ids) + b for b, o in zip(bases, outs, strict=True)]


def _run(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()}
                                                for d in c.logprobs]) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for req_a, req_b in zip(a, b, strict=True):
        for (tok_a, text_a, fin_a, stop_a, lp_a), (tok_b, text_b, fin_b, stop_b, lp_b) in zip(
                req_a, req_b, strict=True):
            assert tok_a == tok_b
            assert (text_a, fin_a, stop_a) == (text_b, fin_b, stop_b)
            assert (lp_a is None) == (lp_b is None)
            for da, db in zip(lp_a or [], lp_b or [], strict=True):
                assert da.keys() == db.keys()
                assert all(da[t] == db[t] or abs(da[t] - db[t]) < 1e-4 for t in da)  # -inf: masked


def _accepted(llm: Any) -> int:
    return llm.get_stats().spec_decoding.num_accepted_tokens


def _drafted(llm: Any) -> int:
    return llm.get_stats().spec_decoding.num_draft_tokens


def _assert_no_leak(llm: Any) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


PARAMS = {
    "greedy": dict(temperature=0.0),
    "greedy_logprobs": dict(temperature=0.0, logprobs=3),
    # (the tiny random model's distributions are flat: low temperatures or small top-k give
    # drafts a chance)
    "seeded": dict(temperature=0.8, top_k=2, seed=11, logprobs=2),
    "top_p_top_k": dict(temperature=0.7, top_p=0.9, top_k=3, seed=3),
    "min_p": dict(temperature=0.5, min_p=0.3, seed=4),
    "penalties": dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3,
                      presence_penalty=0.2),
    "seeded_penalties": dict(temperature=0.6, top_k=3, seed=9, frequency_penalty=0.5),
    "min_tokens_bad_words": dict(temperature=0.0, min_tokens=20, ignore_eos=False),
    "logit_bias": dict(temperature=0.0, logit_bias={2: 3.0}),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_speculation_leaves_outputs_of_every_sampling_parameter_unchanged(
        plain: Any, spec: Any, prompts: list[list[int]], name: str) -> None:
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": True, **PARAMS[name]})
    accepted, drafted = _accepted(spec), _drafted(spec)
    _assert_same(_run(plain, prompts, params), _run(spec, prompts, params))
    assert _drafted(spec) > drafted  # drafts were verified
    if name not in ("seeded", "penalties", "seeded_penalties"):  # these rarely repeat
        assert _accepted(spec) > accepted
    _assert_no_leak(spec)


def test_stop_tokens_strings_and_max_tokens_met_inside_drafts_end_the_output_there(
        plain: Any, spec: Any, prompts: list[list[int]]) -> None:
    greedy = _run(plain, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    # each request stops on its 15th greedy token (an id), or on the text of its 20th
    stop_ids = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[g[0][0][14]])
                for g in greedy]
    _assert_same(_run(plain, prompts, stop_ids), _run(spec, prompts, stop_ids))
    tok = spec.get_tokenizer()
    stop_strs = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                stop=[tok.decode(g[0][0][19:21]).strip() or "x"]) for g in greedy]
    _assert_same(_run(plain, prompts, stop_strs), _run(spec, prompts, stop_strs))
    for max_tokens in (1, 2, 7, 13):  # a length limit can fall inside a step's drafts
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _assert_same(_run(plain, prompts, params), _run(spec, prompts, params))
    _assert_no_leak(spec)


def test_n_greater_than_one_and_a_structured_request_beside_drafted_ones(
        plain: Any, spec: Any, prompts: list[list[int]]) -> None:
    params = SamplingParams(n=3, temperature=0.9, seed=21, max_tokens=30, ignore_eos=True)
    _assert_same(_run(plain, prompts, params), _run(spec, prompts, params))
    choice = StructuredOutputsParams(choice=["alpha beta gamma", "delta"])
    mixed = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            structured_outputs=choice if i == 0 else None)
             for i in range(len(prompts))]
    before = _accepted(spec)
    out_plain, out_spec = _run(plain, prompts, mixed), _run(spec, prompts, mixed)
    _assert_same(out_plain, out_spec)
    assert out_spec[0][0][1] in ("alpha beta gamma", "delta")
    assert _accepted(spec) > before
    _assert_no_leak(spec)


def test_chunked_prefill_prefix_hits_and_preemption_keep_outputs(
        model: Path, plain: Any, prompts: list[list[int]]) -> None:
    # 24 blocks of 16 tokens for 8 requests growing to ~90 tokens each: preemptions; a 24-token
    # step budget chunks every prompt; the prompts come twice, the second time from the cache
    tight = _llm(model, speculative_config=SPEC, num_kv_blocks=25, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.5, top_k=2, seed=5, max_tokens=48, ignore_eos=True,
                            logprobs=1)
    twice = prompts + prompts
    _assert_same(_run(plain, twice, params), _run(tight, twice, params))
    stats = tight.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decoding.num_accepted_tokens > 0
    _assert_no_leak(tight)


def test_unseeded_sampling_with_speculation_follows_the_target_distribution(
        plain: Any, spec: Any, prompts: list[list[int]]) -> None:
    """Two-sample chi-square test: the first three tokens of 600 unseeded samples with drafts
    against 600 without, over the 7 most frequent outcomes and the rest (df = 7). The threshold
    24.32 is chi-square's 0.999 quantile at 7 df: a correct verifier fails one run in 1,000."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    prompt = prompts[0]
    before = _accepted(spec)
    draws = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        outs = llm.generate([prompt] * 600, params, use_tqdm=False)
        draws[name] = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert _accepted(spec) - before > 100
    pooled = draws["plain"] + draws["spec"]
    top = [k for k, _ in pooled.most_common(7)]
    rows = [[counts[k] for k in top] + [sum(counts.values()) - sum(counts[k] for k in top)]
            for counts in (draws["plain"], draws["spec"])]
    total = sum(map(sum, rows))
    stat = 0.0
    for j in range(len(rows[0])):
        col = rows[0][j] + rows[1][j]
        for row in rows:
            expected = sum(row) * col / total
            if expected > 0:
                stat += (row[j] - expected) ** 2 / expected
    assert stat < 24.32, (stat, rows)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_grammar_keeps_the_drafts_it_accepts_and_masks_every_drafted_position(
        model: Path, prompts: list[list[int]], backend: str) -> None:
    """Drafts the grammar refuses are dropped before the step; each drafted position is masked
    with the grammar advanced over the drafts before it."""
    plain_b = _llm(model, structured_outputs_backend=backend)
    spec_b = _llm(model, structured_outputs_backend=backend, speculative_config=SPEC)
    words = StructuredOutputsParams(regex="((cat|dog|bird|fish) ){12}")
    for params in (SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=words),
                   SamplingParams(temperature=0.8, top_k=3, seed=8, max_tokens=60, logprobs=2,
                                  structured_outputs=words)):
        _assert_same(_run(plain_b, prompts, params), _run(spec_b, prompts, params))
    assert spec_b.get_stats().spec_decoding.num_accepted_tokens > 0
    _assert_no_leak(spec_b)


@pytest.fixture(scope="module")
def suffix(model: Path) -> Any:
    return _llm(model, speculative_config={"method": "suffix", "num_speculative_tokens": 6,
                                           "max_draft_tokens_per_step": None})


@pytest.mark.parametrize("name", ["greedy_logprobs", "seeded", "min_p", "penalties"])
def test_suffix_decoding_leaves_outputs_unchanged(plain: Any, suffix: Any, prompts: list[list[int]],
                                                  name: str) -> None:
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": True, **PARAMS[name]})
    drafted = suffix.get_stats().spec_decoding.num_draft_tokens
    _assert_same(_run(plain, prompts, params), _run(suffix, prompts, params))
    assert suffix.get_stats().spec_decoding.num_draft_tokens > drafted
    _assert_no_leak(suffix)


def test_the_default_model_rewriting_a_passage_is_unchanged_by_speculation(
        default_model_dir: Path) -> None:
    """SmolLM2-135M (float32) asked to repeat a passage, greedy and seeded, in one batch: n-gram
    drafts from the prompt are accepted, and the output is the plain engine's."""
    from benchmarks.bench_spec import PASSAGE

    plain_d = _llm(default_model_dir, num_kv_blocks=None, max_model_len=1024)
    spec_d = _llm(default_model_dir, num_kv_blocks=None, max_model_len=1024,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    tok = plain_d.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Repeat this passage:\n\n" + PASSAGE}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    params = [SamplingParams(temperature=0.0, max_tokens=48, logprobs=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=48),
              SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.1)]
    _assert_same(_run(plain_d, [prompt] * 3, params), _run(spec_d, [prompt] * 3, params))
    stats = spec_d.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0
    _assert_no_leak(spec_d)


@pytest.mark.parametrize("draft_arch", ["llama", "mistral"])
def test_a_draft_model_keeps_outputs_unchanged_and_frees_its_blocks(
        tiny_model_dir: Callable[[str], Path], plain: Any, prompts: list[list[int]],
        draft_arch: str) -> None:
    """The target itself as its draft (its greedy drafts are right) and another random model of
    the same vocabulary (mostly wrong): the output is the plain engine's either way, preemption
    and chunked prefill included, and every draft block is back at the end."""
    draft = tiny_model_dir(draft_arch)
    spec_m = _llm(tiny_model_dir("llama"), num_kv_blocks=25, max_num_batched_tokens=48,
                  speculative_config={"model": str(draft), "num_speculative_tokens": 3,
                                      "max_draft_tokens_per_step": None})
    for name in ("greedy_logprobs", "seeded", "penalties"):
        params = SamplingParams(**{"max_tokens": 40, "ignore_eos": True, **PARAMS[name]})
        _assert_same(_run(plain, prompts + prompts[:2], params),
                     _run(spec_m, prompts + prompts[:2], params))
    stats = spec_m.get_stats()
    assert stats.spec_decoding.num_draft_tokens > 0 and stats.num_preemptions > 0
    if draft_arch == "llama":
        assert stats.spec_decoding.num_accepted_tokens > stats.spec_decoding.num_draft_tokens // 2
    _assert_no_leak(spec_m)
    # finished requests' draft state goes with the next step (the runner hears of them then): a
    # one-token request, which drafts nothing, brings it
    spec_m.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    proposer = spec_m.engine_core.runner.spec.draft
    assert proposer.num_free_blocks == proposer.runner.num_blocks - 1
    assert not proposer.runner.requests


def test_a_draft_model_is_refused_with_tensor_parallelism_or_without_its_name(model: Path) -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"speculative_config\.method draft_model runs with"):
        EngineConfig(model=str(model), tensor_parallel_size=2,
                     speculative_config={"model": str(model)})
    with pytest.raises(ValueError, match=r"speculative_config\.model: method draft_model needs"):
        EngineConfig(model=str(model), speculative_config={"method": "draft_model"})
