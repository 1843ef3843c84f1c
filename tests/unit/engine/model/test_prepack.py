"""Prepacked CPU weights (engine.model.prepack): bf16 bit-identical to F.linear, whole model
included; float32 equal to it up to rounding; other dtypes, devices and the off switch left
plain."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import linear
from engine.model.prepack import LINEAR_WEIGHTS, can_prepack, prepack_linear_weights

needs_bf16 = pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu"),
                                reason="oneDNN has no bf16 GEMM on this CPU: nothing is packed")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_gives_f_linears_bits(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if with_bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert packed.is_mkldnn
    threads = torch.get_num_threads()
    try:  # one thread: the same sums in the same order, bit for bit
        torch.set_num_threads(1)
        assert torch.equal(linear(x, packed, b), F.linear(x, w, b))
        assert torch.equal(linear(x[:, :96], packed, b), F.linear(x, w, b))  # a view is fine
    finally:
        torch.set_num_threads(threads)
    # More threads: oneDNN may split the two GEMMs' work differently on CPUs without native bf16
    # (seen on an AVX-512 Xeon without BF16 at 2 threads): within one bf16 rounding.
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=2**-7, atol=2**-7)


@needs_bf16
@pytest.mark.parametrize("name", ["llama_tied", "qwen2_bias", "mistral"])
def test_a_prepacked_bf16_model_gives_the_same_logits(name: str, paged_driver: Any) -> None:
    from tests.unit.engine.model.conftest import make_hf_model, make_our_model

    model = make_our_model(make_hf_model(name)).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    count = prepack_linear_weights(model)
    assert count == 4 * model.num_layers + 1  # qkv, o, gate_up, down per layer, and the head
    assert all(not getattr(m, n).is_mkldnn for m in plain.modules() for n in LINEAR_WEIGHTS
               if isinstance(getattr(m, n, None), torch.Tensor))
    assert not model.embed_tokens.is_mkldnn  # a tied head packs a copy; the lookup keeps rows
    batch = [("a", list(range(3, 20))), ("b", [5, 9, 11])]
    got = paged_driver(model).step(batch)
    want = paged_driver(plain).step(batch)
    for rid in ("a", "b"):
        assert torch.equal(got[rid], want[rid])
    assert prepack_linear_weights(model) == 0  # packed weights are left alone


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_a_packed_float32_weight_is_f_linear_up_to_rounding(rows: int) -> None:
    if not can_prepack(torch.float32, "cpu"):
        pytest.skip("no oneDNN in this torch build")
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    exact = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(linear(x, packed, b).double(), exact, rtol=1e-5, atol=1e-4)


def test_other_devices_and_dtypes_and_the_off_switch_are_not_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not can_prepack(torch.float16, "cpu")
    assert not can_prepack(torch.bfloat16, "meta")
    layer = torch.nn.Module()
    layer.o_weight = torch.nn.Parameter(torch.randn(8, 8).double())
    assert prepack_linear_weights(layer) == 0 and isinstance(layer.o_weight, torch.nn.Parameter)
    layer.o_weight = torch.nn.Parameter(torch.randn(8, 8))
    monkeypatch.setenv("PDSERVE_DISABLE_PREPACK", "1")
    assert prepack_linear_weights(layer) == 0 and not layer.o_weight.is_mkldnn
