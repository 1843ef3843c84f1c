"""The fused bf16 CPU RMSNorm (+ add) and rotary kernels against their PyTorch references
(the engine's own bf16 code): rotary bit for bit, RMSNorm within two bf16 ulps on rare elements
(its float32 sum of squares is added in another order; one ulp of the normed value can become
two after the rounded multiply by the weight)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="no C compiler: kernel not built")


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 7, 64, 2048])  # 2048 x 576 takes the threaded loop
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_add", [False, True])
def test_rms_norm_matches_the_reference(rows: int, hidden: int, with_add: bool) -> None:
    x, add, w = _bf16(rows, hidden, seed=1, scale=3.0), _bf16(rows, hidden, seed=2), _bf16(hidden, seed=3)
    total, out = fused_ops.add_rms_norm(x, add if with_add else None, w, 1e-5)
    if with_add:
        want_total, want = fused_ops.add_rms_norm_reference(x, add, w, 1e-5)
        assert total is not None and torch.equal(total, want_total)  # the add is exact
    else:
        assert total is None
        want = fused_ops.rms_norm_reference(x, w, 1e-5)
    ulps = _ulps(out, want)
    assert int(ulps.max()) <= 2
    assert float((ulps > 0).float().mean()) < 0.01


def test_rms_norm_reads_strided_rows() -> None:
    wide = _bf16(5, 160, seed=4)
    x = wide[:, 16:144]  # rows 160 apart, 128 contiguous elements each
    w = _bf16(128, seed=5)
    assert fused_ops.norm_applies(x, w)
    _, out = fused_ops.add_rms_norm(x, None, w, 1e-6)
    assert int(_ulps(out, fused_ops.rms_norm_reference(x.contiguous(), w, 1e-6)).max()) <= 2


def test_inputs_the_kernels_do_not_take_are_refused() -> None:
    w = _bf16(64, seed=0)
    assert not fused_ops.norm_applies(_bf16(4, 64, seed=0).float(), w)  # float32
    assert not fused_ops.norm_applies(_bf16(4, 64, seed=0).t(), w)  # columns not contiguous
    assert not fused_ops.norm_applies(_bf16(2, 4, 64, seed=0), w)  # not rows
    table = torch.randn(10, 8)
    assert not fused_ops.rotary_applies(_bf16(3, 2, 16, seed=0).float(), table, 16)
    assert not fused_ops.rotary_applies(_bf16(3, 2, 16, seed=0), table.double(), 16)
    with pytest.raises(ValueError, match="one table row per token"):
        fused_ops.rotary_(_bf16(3, 2, 16, seed=0), table, table, torch.tensor([0, 1]), 16)


@pytest.mark.parametrize("tokens", [1, 64, 700])
@pytest.mark.parametrize("heads, head_dim, rotary_dim", [(12, 64, 64), (5, 128, 128), (4, 96, 64),
                                                         (2, 256, 256)])
def test_rotary_matches_the_reference_bit_for_bit(tokens: int, heads: int, head_dim: int,
                                                  rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(tokens + heads)
    angles = torch.rand(4096, rotary_dim // 2, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()
    rows = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = _bf16(tokens, heads + 3, head_dim, seed=tokens)
    x = qkv[:, :heads]  # a view with a token stride, as the engine passes q and k
    want = fused_ops.rotary_reference(x, cos[rows], sin[rows], rotary_dim)
    untouched = qkv[:, heads:].clone()
    got = fused_ops.rotary_(x, cos, sin, rows, rotary_dim)
    assert got.data_ptr() == x.data_ptr()  # in place
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, heads:], untouched)  # the rest of the row is not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 3000])  # 3000 x 2 x 64 takes the threaded loop
def test_kv_write_copies_exactly_like_the_reference(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    blocks, block_size, kv_heads, d = 400, 16, 2, 64
    qkv = torch.randn(tokens, 8, d, generator=g).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # views with a token stride, as the engine passes
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[::4] = -1  # skipped tokens
    cache = torch.randn(blocks, 2, block_size, kv_heads, d, generator=g).to(dtype)
    want = cache.clone()
    fused_ops.write_kv_reference(want, key, value, slots)
    assert fused_ops.write_kv_applies(cache, key, value, slots)
    fused_ops.write_kv(cache, key, value, slots)
    assert torch.equal(cache, want)


def test_kv_write_refuses_what_it_cannot_copy() -> None:
    cache = torch.zeros(4, 2, 4, 2, 8)
    key = torch.zeros(3, 2, 8)
    assert not fused_ops.write_kv_applies(cache.bfloat16(), key, key, torch.zeros(3, dtype=torch.long))
    assert not fused_ops.write_kv_applies(cache, key, key, torch.zeros(3, dtype=torch.int32))
    assert not fused_ops.write_kv_applies(cache, key.transpose(1, 2).contiguous().transpose(1, 2),
                                          key, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_silu_and_mul_matches_the_reference(tokens: int) -> None:
    gate_up = _bf16(tokens, 2 * 1536, seed=tokens, scale=4.0)
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    assert fused_ops.silu_and_mul_applies(gate, up)
    got = fused_ops.silu_and_mul(gate, up)
    want = fused_ops.silu_and_mul_reference(gate, up)
    ulps = _ulps(got, want)
    assert int(ulps.max()) <= 2  # exp differs from PyTorch's in the last bits: 1 ulp of silu, 2 after * up
    assert float((ulps > 0).float().mean()) < 0.01
