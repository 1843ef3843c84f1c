"""apply_token_bitmask equals its bit-by-bit reference and xgrammar's own
`apply_token_bitmask_inplace`, on random bitmasks over vocabularies that are not a multiple of
32, on a subset of rows, and with a model vocabulary wider than the bitmask (those extra columns
are forbidden: xgrammar leaves them alone, so it is compared on the columns it covers)."""

from __future__ import annotations

import pytest
import torch

from engine.structured.bitmask import (
    additive_mask,
    allowed_mask,
    apply_additive_mask,
    apply_token_bitmask,
    apply_token_bitmask_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_case(rows: int, vocab: int, words: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)  # [rows, vocab] float32
    bits = torch.randint(0, 2**32, (rows, words), generator=g, dtype=torch.int64)
    return logits, (bits - 2**31).to(torch.int32)  # [rows, words] int32, every bit pattern


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "vocab", "subset"), [
    (1, 32, [0]), (3, 100, [0, 1, 2]), (5, 1000, [4, 1]), (4, 49152, [2, 0, 3]), (6, 65, []),
])
def test_matches_the_reference_and_xgrammar(device: str, rows: int, vocab: int,
                                            subset: list[int]) -> None:
    import xgrammar as xgr

    logits, full = random_case(rows, vocab, (vocab + 31) // 32, seed=vocab + rows)
    logits, full = logits.to(device), full.to(device)
    ours = logits.clone()
    apply_token_bitmask(ours, full[subset], subset)  # row i of the bitmask for rows[i]
    theirs = logits.clone()
    if subset:
        xgr.apply_token_bitmask_inplace(theirs, full, indices=subset)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    if vocab <= 1000:  # the bit-by-bit loop is slow
        ref = logits.cpu().clone()
        apply_token_bitmask_reference(ref, full[subset].cpu(), subset)
        torch.testing.assert_close(ours.cpu(), ref, rtol=0, atol=0)
    untouched = [r for r in range(rows) if r not in subset]
    assert torch.equal(ours[untouched], logits[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_vocab_wider_than_the_bitmask_forbids_the_extra_columns(device: str) -> None:
    import xgrammar as xgr

    rows, vocab, words = 3, 100, 2  # the bitmask covers 64 tokens
    logits, bitmask = random_case(rows, vocab, words, seed=1)
    logits, bitmask = logits.to(device), bitmask.to(device)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, list(range(rows)))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=64)
    torch.testing.assert_close(ours[:, :64], theirs[:, :64], rtol=0, atol=0)
    assert torch.isneginf(ours[:, 64:]).all()
    ref = logits.cpu().clone()
    apply_token_bitmask_reference(ref, bitmask.cpu(), list(range(rows)))
    torch.testing.assert_close(ours.cpu(), ref, rtol=0, atol=0)


def test_bits_are_read_lowest_first_as_the_backends_write_them() -> None:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, 70)  # all allowed
    assert allowed_mask(bitmask, 70).all()
    xgr.reset_token_bitmask(bitmask)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1 << 3  # token 67
    bitmask[0, 1] = -(2**31)  # bit 31 of word 1: token 63 (the sign bit)
    assert allowed_mask(bitmask, 70)[0].nonzero().flatten().tolist() == [5, 63, 67]


def test_no_rows_leaves_the_logits_alone() -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(("rows", "vocab", "words", "subset"), [
    (1, 32, 1, [0]), (3, 100, 4, [0, 1, 2]), (5, 1000, 32, [4, 1]), (4, 49152, 1536, [2, 0, 3]),
    (16, 49152, 1536, list(range(16))), (3, 100, 2, [1, 2, 0]), (6, 65, 3, []),
])
def test_the_additive_mask_masks_as_the_bitmask_does(rows: int, vocab: int, words: int,
                                                     subset: list[int]) -> None:
    """The CPU step's path (additive mask made in the fill thread, added to the logits) equals
    the masked fill, xgrammar's kernel and the bit-by-bit reference, bit for bit; columns past
    the bitmask (words * 32 < vocab) are forbidden."""
    logits, full = random_case(rows, vocab, words, seed=vocab + rows + words)
    logits[0, :7] = torch.tensor([0.0, -0.0, 1e30, -1e30, float("-inf"), 1e-45, -1e-45])
    ours = logits.clone()
    additive = additive_mask(full[subset], vocab)
    assert additive.shape == (len(subset), vocab) and additive.dtype == torch.float32
    apply_additive_mask(ours, additive, subset)
    masked = logits.clone()
    apply_token_bitmask(masked, full[subset], subset)
    assert torch.equal(ours, masked)
    if vocab <= 1000:
        ref = logits.clone()
        apply_token_bitmask_reference(ref, full[subset], subset)
        assert torch.equal(ours, ref)
    untouched = [r for r in range(rows) if r not in subset]
    assert torch.equal(ours[untouched], logits[untouched])


def test_the_additive_mask_is_zero_where_allowed_and_neg_inf_elsewhere() -> None:
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -(2**31)  # token 63
    additive = additive_mask(bitmask, 100)  # the bitmask covers 96
    assert (additive[0] == 0).nonzero().flatten().tolist() == [5, 63]
    assert torch.isneginf(additive[0]).sum() == 98
