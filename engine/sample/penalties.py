"""Logit edits that depend on a request's token history: min_tokens masking and penalties.

Both work on all rows at once; token-id lists are padded with `vocab_size`, a column that is
counted in a scratch bin and dropped.
"""

from __future__ import annotations

import torch

from engine.sample.metadata import PenaltyInputs


def apply_min_tokens(logits: torch.Tensor, masks: dict[int, list[int]]) -> torch.Tensor:
    """Forbids (sets to -inf) each row's stop ids while it has fewer than min_tokens outputs.

    logits: [num_rows, vocab] float32, edited in place and returned.
    """
    if not masks:
        return logits
    vocab = logits.shape[1]
    pairs = [(r, t) for r, ids in masks.items() for t in ids if 0 <= t < vocab]
    if pairs:
        idx = torch.tensor(pairs, dtype=torch.int64, device=logits.device)  # [num_pairs, 2]
        logits[idx[:, 0], idx[:, 1]] = float("-inf")
    return logits


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token per row. token_ids: [num_rows, width] padded with vocab_size;
    returns [num_rows, vocab_size] int64."""
    num_rows = token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only).

    Repetition as in HF/vLLM: a seen token's logit is divided by the penalty when positive and
    multiplied by it when negative. Frequency subtracts `frequency * count`, presence subtracts
    `presence` once per seen output token. logits: [num_rows, vocab] float32; returns a new tensor.
    """
    vocab = logits.shape[1]
    out_counts = token_counts(pen.output_token_ids, vocab)  # [num_rows, vocab]
    out_seen = out_counts > 0
    prompt_seen = token_counts(pen.prompt_token_ids, vocab) > 0
    seen = out_seen | prompt_seen  # [num_rows, vocab]
    rep = torch.where(seen, pen.repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - pen.frequency[:, None] * out_counts.to(logits.dtype)
    return logits - pen.presence[:, None] * out_seen.to(logits.dtype)
