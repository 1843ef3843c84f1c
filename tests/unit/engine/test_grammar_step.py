"""The structured-output work of one engine step: xgrammar's CPU kernel masks the logits
exactly as the PyTorch masked fill and the bit-by-bit reference do."""

from __future__ import annotations

import pytest
import torch

from engine.structured.bitmask import (
    apply_token_bitmask_cpu,
    apply_token_bitmask_reference,
    apply_token_bitmask_torch,
)

VOCAB = 49152


def random_case(rows: int, vocab: int, words: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**32, (rows, words), generator=g, dtype=torch.int64)
    return torch.randn(rows, vocab, generator=g), (bits - 2**31).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab", "words", "subset"), [
    (1, 32, 1, [0]),
    (4, 100, 4, [0, 1, 2, 3]),  # vocab not a multiple of 32
    (5, 1000, 32, [4, 1]),  # rows out of order: bitmask row i is logits row subset[i]
    (3, 100, 2, [2, 0]),  # a model vocab wider than the bitmask: the rest is forbidden
    (16, VOCAB, VOCAB // 32, list(range(16))),  # the default model's step
])
def test_the_cpu_kernel_and_the_pytorch_fill_agree_with_the_reference(
        dtype: torch.dtype, rows: int, vocab: int, words: int, subset: list[int]) -> None:
    logits, full = random_case(rows, vocab, words, seed=rows * vocab)
    logits = logits.to(dtype)
    bitmask = full[: len(subset)]
    kernel, fill = logits.clone(), logits.clone()
    apply_token_bitmask_cpu(kernel, bitmask, subset)
    apply_token_bitmask_torch(fill, bitmask, subset)
    assert torch.equal(kernel, fill)
    if vocab <= 1000:  # the bit-by-bit loop is slow
        ref = logits.clone()
        apply_token_bitmask_reference(ref, bitmask, subset)
        assert torch.equal(kernel, ref)
    untouched = [r for r in range(rows) if r not in subset]
    assert torch.equal(kernel[untouched], logits[untouched])
