"""Sampler tests: each step against a plain per-row reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from engine.sample.seeds import position_seed
from engine.sampling_params import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


def _meta(params: list[SamplingParams], outputs: list[list[int]] | None = None,
          prompts: list[list[int]] | None = None,
          eos: int | None = None, vocab: int = VOCAB) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
        eos, vocab, CPU)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 3


# --- plain references -------------------------------------------------------------------
def _ref_top_k(row: list[float], k: int) -> list[bool]:
    kth = sorted(row, reverse=True)[k - 1]
    return [x >= kth for x in row]


def _ref_top_p(row: list[float], p: float) -> list[bool]:
    if p >= 1.0:
        return [x != -math.inf for x in row]
    finite = [x for x in row if x != -math.inf]
    z = sum(math.exp(x - max(finite)) for x in finite)
    probs = [math.exp(x - max(finite)) / z if x != -math.inf else 0.0 for x in row]
    keep = [False] * len(row)
    cum = 0.0
    for i in sorted(range(len(row)), key=lambda j: -probs[j]):
        if probs[i] == 0.0:
            break
        keep[i] = True
        cum += probs[i]
        if cum >= p:
            break
    return keep


def _ref_min_p(row: list[float], min_p: float) -> list[bool]:
    z = sum(math.exp(x - max(row)) for x in row)
    probs = [math.exp(x - max(row)) / z for x in row]
    return [q >= min_p * max(probs) for q in probs]


def _ref_penalties(row: list[float], prompt: list[int], output: list[int],
                   p: SamplingParams) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


# --- masks ------------------------------------------------------------------------------
def test_top_k_keeps_each_rows_k_largest_logits() -> None:
    logits = _logits(6)
    ks = [1, 3, 7, VOCAB, 20, 2]
    masked = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for i, k in enumerate(ks):
        assert torch.isfinite(masked[i]).tolist() == _ref_top_k(logits[i].tolist(), k)
        kept = torch.isfinite(masked[i])
        assert torch.equal(masked[i][kept], logits[i][kept])


def test_top_p_keeps_smallest_most_likely_set_reaching_p() -> None:
    logits = _logits(8, seed=1)
    ps = [0.05, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0, 0.6]
    masked = apply_top_k_top_p(logits, None, torch.tensor(ps))
    for i, p in enumerate(ps):
        assert torch.isfinite(masked[i]).tolist() == _ref_top_p(logits[i].tolist(), p)


def test_top_p_on_a_large_vocab_matches_reference_peaked_or_flat() -> None:
    vocab = 4096  # more than the candidates looked at before a full sort
    logits = torch.cat([_logits(2, vocab, seed=12) * 3, _logits(2, vocab, seed=13) * 0.05])
    ps = [0.9, 1.0, 0.9, 0.5]  # rows 2 and 3 are nearly flat: the full-sort fallback
    masked = apply_top_k_top_p(logits, None, torch.tensor(ps))
    for i, p in enumerate(ps):
        assert torch.isfinite(masked[i]).tolist() == _ref_top_p(logits[i].tolist(), p)
    assert 1 < int(torch.isfinite(masked[0]).sum()) < 1024 < int(torch.isfinite(masked[2]).sum())


def test_top_k_then_top_p_matches_sequential_reference() -> None:
    logits = _logits(5, seed=2)
    ks, ps = [5, 10, VOCAB, 1, 30], [0.5, 0.9, 0.7, 0.2, 1.0]
    masked = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for i in range(5):
        row = logits[i].tolist()
        after_k = [x if keep else -math.inf for x, keep in zip(row, _ref_top_k(row, ks[i]),
                                                               strict=True)]
        assert torch.isfinite(masked[i]).tolist() == _ref_top_p(after_k, ps[i])


def test_min_p_drops_tokens_below_fraction_of_max_probability() -> None:
    logits = _logits(4, seed=3)
    mps = [0.0, 0.01, 0.1, 0.5]
    masked = apply_min_p(logits, torch.tensor(mps))
    for i, mp in enumerate(mps):
        assert torch.isfinite(masked[i]).tolist() == _ref_min_p(logits[i].tolist(), mp)


# --- full sampler -----------------------------------------------------------------------
def test_all_greedy_batch_returns_argmax() -> None:
    logits = _logits(7, seed=4)
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0)] * 7))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = _logits(2, seed=5)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, min_tokens=2)] * 2
    Sampler()(logits, _meta(params, outputs=[[1], [2]], eos=0))
    assert torch.equal(logits, before)


def test_penalties_match_reference_and_drive_greedy_choice() -> None:
    logits = _logits(4, seed=6)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.8),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, presence_penalty=-0.5,
                       frequency_penalty=0.3),
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9, 10, 11]]
    outputs = [[12, 12, 13], [4, 4, 14], [15, 15, 15, 16], [7, 17, 17]]
    from engine.sample.penalties import apply_penalties

    meta = _meta(params, outputs, prompts)
    assert meta.penalties is not None
    got = apply_penalties(logits.clone(), meta.penalties)
    for i, p in enumerate(params):
        ref = _ref_penalties(logits[i].tolist(), prompts[i], outputs[i], p)
        assert got[i].tolist() == pytest.approx(ref, rel=1e-6, abs=1e-6)
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, got.argmax(dim=-1))


def test_min_tokens_forbids_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, 0] = 100.0  # eos
    logits[:, 9] = 90.0  # a stop token id
    logits[:, 20] = 10.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]),  # 2 outputs: masked
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),  # 2 outputs: free
        SamplingParams(temperature=0.0, min_tokens=5),  # eos masked, 9 is not a stop id
        SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True),  # eos allowed
    ]
    out = Sampler()(logits, _meta(params, outputs=[[1, 2]] * 4, eos=0))
    assert out.sampled_token_ids.tolist() == [20, 0, 9, 0]


def test_logprobs_are_raw_log_softmax_with_sampled_rank() -> None:
    logits = _logits(3, seed=7)
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, logprobs=0, seed=3),
        SamplingParams(temperature=0.0),
    ]
    meta = _meta(params, outputs=[[int(logits[0].argmax())], [], []])
    out = Sampler()(logits, meta)
    assert out.logprobs is not None
    ref = torch.log_softmax(logits.double(), dim=-1)
    top = ref[0].topk(5)
    assert out.logprobs.top_token_ids[0].tolist() == top.indices.tolist()
    assert out.logprobs.top_logprobs[0].tolist() == pytest.approx(top.values.tolist(), abs=1e-5)
    for i in range(3):
        tok = int(out.sampled_token_ids[i])
        assert float(out.logprobs.sampled_logprobs[i]) == pytest.approx(float(ref[i, tok]),
                                                                        abs=1e-5)
        assert int(out.logprobs.sampled_ranks[i]) == int((ref[i] > ref[i, tok]).sum()) + 1
    # the penalty moved row 0 away from the raw argmax, so its rank is worse than 1
    assert int(out.logprobs.sampled_ranks[0]) > 1


def test_seeded_rows_do_not_depend_on_batch_composition_or_order() -> None:
    logits = _logits(4, seed=8)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (11, 12)]
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)]

    def run(rows: list[int], plist: list[SamplingParams], sampler: Sampler,
            steps: int = 5) -> list[list[int]]:
        tokens: list[list[int]] = []
        outputs: list[list[int]] = [[] for _ in rows]
        for _ in range(steps):
            out = sampler(logits[rows], _meta(plist, outputs=outputs)).sampled_token_ids.tolist()
            tokens.append(out)
            outputs = [[*o, t] for o, t in zip(outputs, out, strict=True)]
        return tokens

    alone = run([0], params[:1], Sampler(seed=1))
    batched = run([2, 0, 3, 1], [others[0], params[0], others[1], params[1]], Sampler(seed=2))
    reordered = run([1, 3, 0], [params[1], others[1], params[0]], Sampler(seed=3))
    assert [t[0] for t in alone] == [t[1] for t in batched] == [t[2] for t in reordered]
    assert [t[3] for t in batched] == [t[0] for t in reordered]


def test_a_seeded_draw_depends_only_on_seed_and_output_position() -> None:
    """The draw at output position k is the same whatever ran before it (another worker's
    steps, a preemption, a fresh sampler): what split and migrated samples rely on."""
    logits = torch.zeros(1, VOCAB)  # uniform: the token is the draw itself
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(position: int, sampler: Sampler) -> int:
        return int(sampler(logits, _meta([p], outputs=[[3] * position])).sampled_token_ids[0])

    fresh = [draw(k, Sampler(seed=k)) for k in range(12)]
    shared = Sampler(seed=99)
    assert [draw(k, shared) for k in range(12)] == fresh  # same positions, one sampler
    assert len(set(fresh)) > 4  # positions give different draws
    other_seed = [int(Sampler()(logits, _meta([SamplingParams(temperature=1.0, seed=8)],
                                              outputs=[[3] * k])).sampled_token_ids[0])
                  for k in range(12)]
    assert other_seed != fresh


def test_position_seeds_are_distinct_across_neighbouring_seeds_and_positions() -> None:
    seeds = {position_seed(s, k) for s in range(-50, 50) for k in range(100)}
    assert len(seeds) == 100 * 100
    assert all(0 <= x < 2**64 for x in seeds)


def test_unseeded_sampling_follows_the_sampler_seed() -> None:
    logits = torch.zeros(64, VOCAB)  # uniform: every draw is a fresh random choice
    meta = _meta([SamplingParams(temperature=1.0)] * 64)
    a, b, c = (Sampler(seed=s)(logits, meta).sampled_token_ids for s in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_temperature_sampling_frequencies_match_softmax() -> None:
    vocab, draws, temp = 8, 40_000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    logits = row.expand(draws, vocab).contiguous()
    out = Sampler(seed=0)(logits, _meta([SamplingParams(temperature=temp)] * draws, vocab=vocab))
    freq = torch.bincount(out.sampled_token_ids, minlength=vocab).double() / draws
    expected = torch.softmax(row.double() / temp, dim=0)
    assert torch.allclose(freq, expected, atol=0.01)


def test_top_k_and_min_p_restrict_the_tokens_actually_sampled() -> None:
    draws = 5_000
    row = _logits(1, seed=10)[0]
    logits = row.expand(draws, VOCAB).contiguous()
    params = [SamplingParams(temperature=1.5, top_k=3)] * (draws // 2) + \
        [SamplingParams(temperature=1.5, min_p=0.3)] * (draws - draws // 2)
    out = Sampler(seed=0)(logits, _meta(params))
    top3 = set(row.topk(3).indices.tolist())
    assert set(out.sampled_token_ids[: draws // 2].tolist()) <= top3
    probs = torch.softmax(row / 1.5, dim=0)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(out.sampled_token_ids[draws // 2:].tolist()) <= allowed


def test_mixed_batch_greedy_rows_take_argmax_random_rows_sample() -> None:
    logits = _logits(4, seed=11)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=1)]
    out = Sampler()(logits, _meta(params))
    argmax = logits.argmax(dim=-1).tolist()
    got = out.sampled_token_ids.tolist()
    assert got[:3] == argmax[:3]  # top_k=1 leaves only the argmax
    assert 0 <= got[3] < VOCAB
