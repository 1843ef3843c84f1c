"""Logit edits of the sampler before temperature: banned tokens (min_tokens, bad_words),
allowed_token_ids, logit_bias, and the penalties.

Penalties work on all rows at once; token-id lists are padded with `vocab_size`, a column that is
counted in a scratch bin and dropped.
"""

from __future__ import annotations

import torch

from engine.sample.metadata import PenaltyInputs


def apply_banned(logits: torch.Tensor, masks: dict[int, list[int]]) -> torch.Tensor:
    """Forbids (sets to -inf) each row's banned ids: its stop ids while it has fewer than
    min_tokens outputs, and the bad_words tokens that would complete a bad word.

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


def apply_allowed(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    """Forbids every token but the row's allowed_token_ids. logits: [num_rows, vocab] float32,
    edited in place and returned."""
    if not allowed:
        return logits
    rows = list(allowed)
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for i, row in enumerate(rows):
        keep[i, torch.as_tensor(allowed[row], dtype=torch.int64, device=logits.device)] = True
    row_idx = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
    logits[row_idx] = logits[row_idx].masked_fill(~keep, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """Adds each row's logit_bias to its token logits. logits: [num_rows, vocab] float32,
    edited in place and returned."""
    if not bias:
        return logits
    triples = [(r, t, b) for r, row in bias.items() for t, b in row.items()]
    rows = torch.tensor([t[0] for t in triples], dtype=torch.int64, device=logits.device)
    cols = torch.tensor([t[1] for t in triples], dtype=torch.int64, device=logits.device)
    vals = torch.tensor([t[2] for t in triples], dtype=logits.dtype, device=logits.device)
    logits.index_put_((rows, cols), vals, accumulate=True)
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
