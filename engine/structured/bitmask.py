"""Applies a grammar's token bitmask to logits: tokens the grammar forbids get -inf.

The bitmask is xgrammar's and llguidance's layout: int32 words, bit `t % 32` of word `t // 32`
set where token `t` is allowed. Production and reference are both plain PyTorch (no kernel of
ours: the cost is one [rows, vocab] masked fill); the tests check them against xgrammar's own
`apply_token_bitmask_inplace`.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: row `rows[i]` of logits [n, vocab] keeps only the tokens bitmask[i] allows.
    Columns past the bitmask's width (a model vocab wider than the tokenizer's) are forbidden."""
    if not rows:
        return
    vocab = logits.shape[1]
    mask = allowed_mask(bitmask.to(logits.device, non_blocking=True), vocab)  # [k, <=vocab]
    if mask.shape[1] < vocab:
        mask = torch.nn.functional.pad(mask, (0, vocab - mask.shape[1]), value=False)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~mask, float("-inf"))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Token by token, bit by bit (for the tests)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (t % 32)) & 1
            if not allowed:
                logits[row, t] = float("-inf")
