"""`linear`: the same function as `F.linear` (its reference) for every row count, with and without
bias; skinny float32 inputs take the weight-first order, others are `F.linear` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import SKINNY_MAX_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # against float64 too: the weight-first order is as accurate as F.linear's
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)


def test_only_skinny_float32_inputs_change_order() -> None:
    w = torch.randn(64, 32)
    for rows in (1, SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 32)
        assert torch.equal(linear(x, w), F.linear(x, w))
    x64 = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(linear(x64, w.double()), F.linear(x64, w.double()))


def test_a_sliced_input_row_block_works() -> None:
    """Inputs may be views (the MLP feeds `silu(gate) * up` of a fused projection)."""
    big = torch.randn(3, 64)
    x = big[:, :32]
    w = torch.randn(16, 32)
    torch.testing.assert_close(linear(x, w), F.linear(x.contiguous(), w), rtol=1e-5, atol=1e-5)
