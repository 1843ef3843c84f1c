"""Sampler: logits of the sampled rows -> one token per row (vLLM V1's order of operations).

1. raw logprobs (log_softmax of the raw logits) when any row asks for logprobs;
2. allowed_token_ids; banned tokens: stop ids and eos while a row has fewer than min_tokens
   outputs, and each bad word's last token when the output ends with the rest of it;
   logit_bias (vLLM V1's order: these, then the penalties);
3. penalties: repetition (prompt + output), frequency and presence (output);
4. greedy rows: argmax of the penalized logits;
5. temperature -> min-p -> top-k -> top-p -> exponential race `argmax(probs / q)`,
   `q ~ Exp(1)`, taken in log space: `argmax(logits - log q)` (the row's log-normaliser is
   one constant), so no softmax. A seeded row draws its `q` from a generator seeded with
   `position_seed(seed, output_position)`, so its draws depend on nothing but the seed and the
   position of the token in the sample's output: the same tokens in any batch, after a
   preemption, on a prefill worker and then a decode worker, or after a migration to another
   worker. Unseeded rows draw from the sampler's generator.

Both 4 and 5 take an argmax of values each computed from its own token's logit alone (edits that
keep -inf at -inf), except where min-p, top-k or top-p look at the whole row. `argmax_fix`, when
given, sees those values and the argmax of each kind (greedy, then random) and may replace
tokens: the grammar's check of rows that were not masked before step 1 (ArgmaxCheck).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_allowed, apply_banned, apply_logit_bias, apply_penalties


@dataclass
class LogprobsTensors:
    """Raw-distribution logprobs of the sampled rows (before penalties and temperature)."""

    top_token_ids: torch.Tensor  # [num_rows, max_num_logprobs] int64
    top_logprobs: torch.Tensor  # [num_rows, max_num_logprobs] float32
    sampled_logprobs: torch.Tensor  # [num_rows] float32
    sampled_ranks: torch.Tensor  # [num_rows] int64, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobsTensors | None


# (values [num_rows, vocab], their argmax [num_rows], greedy rows or random rows) -> the tokens
ArgmaxFix = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


class Sampler:
    """Stateless apart from the generator used by unseeded rows (seeded by the engine seed)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded = torch.Generator(device=device)  # re-seeded per seeded row and step

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 argmax_fix: ArgmaxFix | None = None) -> SamplerOutput:
        """logits: [num_rows, vocab] float32 (not modified). Returns one token per row.
        `argmax_fix` may replace tokens (it sees the values their argmax saw)."""
        if not meta.needs_full_pipeline:
            tokens = logits.argmax(dim=-1)
            if argmax_fix is not None:
                tokens = argmax_fix(logits, tokens, True)
            return SamplerOutput(tokens, None)
        logits = logits.to(torch.float32).clone()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
        logits = apply_allowed(logits, meta.allowed)
        logits = apply_banned(logits, meta.banned)
        logits = apply_logit_bias(logits, meta.logit_bias)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        sampled = self._sample(logits, meta, argmax_fix)
        lp = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, sampled, meta)
        return SamplerOutput(sampled, lp)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata,
                argmax_fix: ArgmaxFix | None) -> torch.Tensor:
        greedy_tokens = None if meta.all_random else logits.argmax(dim=-1)
        if argmax_fix is not None and greedy_tokens is not None:
            greedy_tokens = argmax_fix(logits, greedy_tokens, True)
        if meta.all_greedy:
            assert greedy_tokens is not None
            return greedy_tokens
        logits = logits / meta.temperature[:, None]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        keys = self._race_keys(logits, meta.seeds)  # [num_rows, vocab]
        random_tokens = keys.argmax(dim=-1)
        if argmax_fix is not None:
            random_tokens = argmax_fix(keys, random_tokens, False)
        if greedy_tokens is None:
            return random_tokens
        return torch.where(meta.greedy, greedy_tokens, random_tokens)

    def _race_keys(self, logits: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
        """logits - log q with q ~ Exp(1) i.i.d.: the row's argmax is a draw from
        softmax(logits) (the exponential race argmax(probs / q), in log space). Rows in `seeds`
        (row -> this step's position seed) draw from a generator seeded with it. -inf logits
        stay -inf (never drawn)."""
        u = torch.empty_like(logits)  # [num_rows, vocab], uniform in [0, 1)
        if len(seeds) < logits.shape[0]:
            u.uniform_(generator=self.generator)
        for row, seed in seeds.items():
            self._seeded.manual_seed(seed)
            u[row].uniform_(generator=self._seeded)
        # q = -log u ~ Exp(1) by inverse CDF; u = 0 (one draw in 2**24) is moved to the smallest
        # float, so every token keeps a finite key (a token the grammar forces always can win)
        log_q = u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_().log_()
        return logits - log_q


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Forbids tokens whose probability is below `min_p * max_prob` of their row.

    logits: [num_rows, vocab]; min_p: [num_rows] (0 = off). Returns a new tensor."""
    probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, then top-p over the renormalized survivors. Returns a new tensor.

    logits: [num_rows, vocab]; top_k: [num_rows] int64 (vocab = off); top_p: [num_rows]
    float32 (1.0 = off)."""
    if top_k is not None:
        logits = apply_top_k(logits, top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k largest logits (ties with the k-th kept); one `topk` of the largest
    enabled k instead of a full sort."""
    vocab = logits.shape[1]
    enabled = top_k < vocab  # [num_rows]
    if not bool(enabled.any()):
        return logits
    k = top_k.clamp(1, vocab)
    max_k = int(k[enabled].max())
    top_values = logits.topk(max_k, dim=-1).values  # [num_rows, max_k], descending
    kth = top_values.gather(1, (k.clamp(max=max_k) - 1)[:, None])  # [num_rows, 1]
    kth = kth.masked_fill(~enabled[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p (a token
    is kept when the probability of the more likely ones is still below top_p).

    Looks at the `_TOP_P_CANDIDATES` most likely tokens first and sorts the whole row only
    when they do not reach top_p."""
    probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab]
    enabled = top_p < 1.0  # [num_rows]
    num_candidates = min(_TOP_P_CANDIDATES, probs.shape[1])
    sorted_probs = probs.topk(num_candidates, dim=-1).values  # [num_rows, c], descending
    cum = sorted_probs.cumsum(dim=-1)
    if not bool(((cum[:, -1] >= top_p) | ~enabled).all()):
        sorted_probs = probs.sort(dim=-1, descending=True).values  # [num_rows, vocab]
        cum = sorted_probs.cumsum(dim=-1)
    num_keep = ((cum - sorted_probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [num_rows]
    threshold = sorted_probs.gather(1, (num_keep - 1)[:, None])  # [num_rows, 1]
    drop = (probs < threshold) & enabled[:, None]
    return logits.masked_fill(drop, float("-inf"))


_TOP_P_CANDIDATES = 1024


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata
) -> LogprobsTensors:
    assert meta.max_num_logprobs is not None
    top_lp, top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)  # [num_rows, n]
    sampled_lp = raw_logprobs.gather(1, sampled[:, None])  # [num_rows, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1  # [num_rows]
    return LogprobsTensors(top_ids, top_lp, sampled_lp.squeeze(1), ranks)
