"""The connector's copies between the paged KV cache and KV_T2D objects: `scatter_tokens` (whole
blocks in one index_copy_, partial blocks token by token) writes exactly the positions asked,
and `gather_tokens` reads them back."""

from __future__ import annotations

import pytest
import torch

from engine.connector.kv_copy import gather_tokens, scatter_tokens

BLOCK, HEADS, DIM = 4, 2, 3


def per_token_reference(kv: torch.Tensor, block_ids: list[int], start: int,
                        data: torch.Tensor) -> None:
    for i in range(data.shape[0]):
        pos = start + i
        kv[block_ids[pos // BLOCK], :, pos % BLOCK] = data[i].reshape(2, HEADS, DIM)


@pytest.mark.parametrize(("start", "n"), [(0, 16), (0, 3), (4, 8), (2, 1), (1, 14), (3, 13),
                                          (0, 17), (5, 2), (6, 9)])
def test_scatter_matches_per_token_writes(start: int, n: int) -> None:
    gen = torch.Generator().manual_seed(start * 31 + n)
    block_ids = [7, 2, 9, 0, 5, 3]  # not in order: blocks come from the allocator
    data = torch.randn(n, 2, HEADS * DIM, generator=gen)
    want = torch.zeros(10, 2, BLOCK, HEADS, DIM)
    got = want.clone()
    per_token_reference(want, block_ids, start, data)
    scatter_tokens(got, block_ids, start, data)
    assert torch.equal(got, want)
    assert torch.equal(gather_tokens(got, block_ids, start, start + n), data)


def test_scatter_accepts_a_non_contiguous_slice_of_an_object() -> None:
    obj = torch.randn(12, 2, HEADS * DIM)
    want = torch.zeros(6, 2, BLOCK, HEADS, DIM)
    got = want.clone()
    per_token_reference(want, [1, 3, 5], 2, obj[2:12])
    scatter_tokens(got, [1, 3, 5], 2, obj[2:12])
    assert torch.equal(got, want)
