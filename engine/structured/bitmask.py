"""Applies a grammar's token bitmask to logits: tokens the grammar forbids get -inf.

The bitmask is xgrammar's and llguidance's layout: int32 words, bit `t % 32` of word `t // 32`
set where token `t` is allowed. On CPU the engine uses xgrammar's C++ kernel (a word at a time,
no temporaries); elsewhere, and as the reference the kernel is tested against, a PyTorch masked
fill; `apply_token_bitmask_reference` spells the rule out token by token.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # xgrammar's CPU kernel


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
    if logits.device.type == "cpu" and bitmask.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES:
        apply_token_bitmask_cpu(logits, bitmask, rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """`apply_token_bitmask` by xgrammar's CPU kernel: one pass over the words, no temporaries,
    one thread (16 rows of a 49,152-token vocabulary: ~3x faster than the masked fill on one
    thread; the fill's 2-thread ops stall badly when the cores are busy elsewhere)."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    bits = bitmask.shape[1] * 32
    if rows != list(range(len(rows))):  # the kernel masks logits[j] by bitmask[j]: line them up
        lined_up = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        lined_up[rows] = bitmask
        bitmask = lined_up
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, bits), indices=rows,
                                    backend="cpu")
    if vocab > bits:
        logits[rows, bits:] = float("-inf")


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """`apply_token_bitmask` as one PyTorch masked fill (any device)."""
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
