"""Per-step sampling inputs: each sampled row's parameters, stacked into tensors.

The model runner builds one `SamplingMetadata` per step with `SamplingMetadata.build(...)` from
the requests that sample in that step (one row each, in batch order). Optional features are
`None` when no row uses them, so the sampler can skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.seeds import position_seed
from engine.sampling_params import SamplingParams


@dataclass
class PenaltyInputs:
    """Penalty parameters and the token histories they count over (rows padded with `vocab`)."""

    presence: torch.Tensor  # [num_rows] float32
    frequency: torch.Tensor  # [num_rows] float32
    repetition: torch.Tensor  # [num_rows] float32
    prompt_token_ids: torch.Tensor  # [num_rows, max_prompt_len] int64, pad = vocab_size
    output_token_ids: torch.Tensor  # [num_rows, max_output_len] int64, pad = vocab_size


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; row `i` is the `i`-th sampling request."""

    temperature: torch.Tensor  # [num_rows] float32, 1.0 on greedy rows
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 where disabled
    seeds: dict[int, int]  # seeded random rows -> position_seed(seed, output position)
    penalties: PenaltyInputs | None
    # row -> token ids forbidden this step: stop ids and eos while short of min_tokens, and
    # the last token of each bad word whose other tokens end the output
    banned: dict[int, list[int]]
    allowed: dict[int, list[int]]  # row -> its allowed_token_ids (rows that restrict)
    logit_bias: dict[int, dict[int, float]]  # row -> its logit_bias (rows that have one)
    num_logprobs: list[int | None]  # per row: top-n to return, or None
    max_num_logprobs: int | None  # max over rows, None when no row asks

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @property
    def needs_full_pipeline(self) -> bool:
        """False when one argmax over the raw logits gives every row's token."""
        return not (
            self.all_greedy
            and self.penalties is None
            and not self.banned
            and not self.allowed
            and not self.logit_bias
            and self.max_num_logprobs is None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Stacks per-request parameters (one entry per sampled row, in row order)."""
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=_top_k(params, greedy, vocab_size, device),
            top_p=_optional_floats([p.top_p for p in params], 1.0, greedy, device),
            min_p=_optional_floats([p.min_p for p in params], 0.0, greedy, device),
            seeds={i: position_seed(p.seed, len(out)) for i, (p, out, g)
                   in enumerate(zip(params, output_token_ids, greedy, strict=True))
                   if p.seed is not None and not g},
            penalties=_penalties(params, output_token_ids, prompt_token_ids, vocab_size, device),
            banned=_banned(params, output_token_ids, eos_token_id),
            allowed={i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids},
            logit_bias={i: p.logit_bias for i, p in enumerate(params) if p.logit_bias},
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
        )


def _top_k(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    ks = [vocab_size if g or p.top_k < 1 else min(p.top_k, vocab_size)
          for p, g in zip(params, greedy, strict=True)]
    if all(k == vocab_size for k in ks):
        return None
    return torch.tensor(ks, dtype=torch.int64, device=device)


def _optional_floats(
    values: list[float], neutral: float, greedy: list[bool], device: torch.device
) -> torch.Tensor | None:
    row_values = [neutral if g else v for v, g in zip(values, greedy, strict=True)]
    if all(v == neutral for v in row_values):
        return None
    return torch.tensor(row_values, dtype=torch.float32, device=device)


def _penalties(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyInputs | None:
    if all(
        p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
        for p in params
    ):
        return None

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return PenaltyInputs(
        presence=floats([p.presence_penalty for p in params]),
        frequency=floats([p.frequency_penalty for p in params]),
        repetition=floats([p.repetition_penalty for p in params]),
        prompt_token_ids=_pad(prompt_token_ids, vocab_size, device),
        output_token_ids=_pad(output_token_ids, vocab_size, device),
    )


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.int64)  # [num_rows, width]
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.int64)
    return out.to(device)


def _banned(
    params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_id: int | None
) -> dict[int, list[int]]:
    masks: dict[int, list[int]] = {}
    for i, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
        ids: list[int] = []
        if len(out) < p.min_tokens:
            ids.extend(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                ids.append(eos_token_id)
        for word in p.bad_words_token_ids or ():
            prefix = len(word) - 1
            if prefix == 0 or (len(out) >= prefix and out[len(out) - prefix:] == word[:-1]):
                ids.append(word[-1])
        if ids:
            masks[i] = ids
    return masks
