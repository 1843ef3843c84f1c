"""The grouped-by-expert MoE path (`moe_grouped`, used on CPU) equals the per-pair reference.

float32: within 1e-5 relative (only the summation order differs). float16 / bfloat16: the
reference computes in float32 from the same low-precision inputs, `moe_grouped` keeps the GEMMs
in the input dtype, so atol/rtol 1e-2 (fp16) and 4e-2 (bf16) on outputs of magnitude ~1.
The reference itself is checked against an independent dense formulation (every expert on every
token, masked) and against transformers' Qwen3-MoE experts with the same weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import ACTIVATIONS, moe_grouped, moe_reference

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


def make_case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
              dtype: torch.dtype = torch.float32, seed: int = 0, ids: torch.Tensor | None = None,
              ) -> dict[str, Any]:
    """Weights scaled by 1/sqrt(fan_in) so outputs are O(1); distinct random experts per token
    (like top-k) unless `ids` is given; routing weights in float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    if ids is None:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
                          ) if num_tokens else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(ids.shape, generator=g)
    return {"x": x.to(dtype), "w13": w13.to(dtype), "w2": w2.to(dtype), "topk_weights": weights,
            "topk_ids": ids}


def dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Every expert on every token in float32, combined with a [T, E] routing matrix."""
    inter, num_experts = w13.shape[1] // 2, w13.shape[0]
    h = torch.einsum("th,eih->eti", x.float(), w13.float())  # [E, T, 2I]
    gate = F.silu(h[..., :inter]) if activation == "silu" else F.gelu(h[..., :inter], approximate="tanh")
    y = torch.einsum("eti,ehi->eth", gate * h[..., inter:], w2.float())  # [E, T, H]
    route = torch.zeros(x.shape[0], num_experts).scatter_add_(1, topk_ids.long(), topk_weights.float())
    return torch.einsum("te,eth->th", route, y).to(x.dtype)


def assert_grouped_matches(case: dict[str, Any], activation: str = "silu") -> torch.Tensor:
    want = moe_reference(**case, activation=activation)
    got = moe_grouped(**case, activation=activation)
    assert got.dtype == case["x"].dtype and got.shape == case["x"].shape
    atol, rtol = TOL[case["x"].dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_equals_dense_formulation(activation: str) -> None:
    case = make_case(9, 32, 24, 6, 2)
    torch.testing.assert_close(moe_reference(**case, activation=activation),
                               dense_moe(**case, activation=activation), atol=1e-5, rtol=1e-5)


def test_reference_equals_transformers_qwen3_moe_experts() -> None:
    """Same weight layout as transformers: gate_up_proj [E, 2I, H] gate rows first, down [E, H, I]."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    case = make_case(7, 32, 16, 5, 3)
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=5,
                            num_experts_per_tok=3, hidden_act="silu")
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(case["w13"])
        experts.down_proj.copy_(case["w2"])
        want = experts(case["x"], case["topk_ids"], case["topk_weights"])
    torch.testing.assert_close(moe_reference(**case), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_equals_reference(dtype: torch.dtype, activation: str) -> None:
    assert_grouped_matches(make_case(37, 64, 48, 8, 3, dtype), activation)


@pytest.mark.parametrize("name, num_tokens, num_experts, top_k, ids", [
    ("experts without tokens", 6, 8, 2, torch.tensor([[1, 5], [5, 1], [1, 6], [6, 5], [1, 5], [5, 6]])),
    ("all tokens to one expert", 10, 4, 1, torch.full((10, 1), 3)),
    ("all pairs to one expert twice", 5, 4, 2, torch.full((5, 2), 0)),
    ("k=1", 11, 6, 1, None),
    ("t=1", 1, 16, 4, None),
    ("t=1, k=1, last expert", 1, 16, 1, torch.tensor([[15]])),
    ("k=e: every expert", 3, 4, 4, None),
    ("int32 ids", 9, 5, 2, torch.tensor([[0, 4]] * 9, dtype=torch.int32)),
])
def test_routing_edge_cases(name: str, num_tokens: int, num_experts: int, top_k: int,
                            ids: torch.Tensor | None) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(num_tokens, 40, 24, num_experts, top_k, dtype, ids=ids)
        assert_grouped_matches(case)
        if dtype == torch.float32:
            torch.testing.assert_close(moe_reference(**case), dense_moe(**case), atol=1e-5, rtol=1e-5)


def test_zero_weights_and_empty_batches_give_zeros() -> None:
    case = make_case(4, 16, 8, 3, 2)
    case["topk_weights"] = torch.zeros(4, 2)
    assert torch.equal(moe_grouped(**case), torch.zeros(4, 16))
    empty = make_case(0, 16, 8, 3, 2, torch.bfloat16)
    for fn in (moe_grouped, moe_reference):
        out = fn(**empty)
        assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_inputs_are_left_alone() -> None:
    case = make_case(12, 32, 16, 4, 2, torch.bfloat16)
    before = {k: v.clone() for k, v in case.items()}
    moe_grouped(**case)
    for k, v in case.items():
        assert torch.equal(v, before[k]), k


def test_strided_inputs_and_bf16_routing_weights() -> None:
    """x as a column slice of a wider buffer, routing weights in bf16 (transformers' router dtype)."""
    case = make_case(8, 32, 16, 4, 2)
    case["x"] = torch.cat([case["x"], torch.randn(8, 5)], dim=1)[:, :32]
    case["topk_weights"] = case["topk_weights"].bfloat16()
    assert_grouped_matches(case)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: {**a, "activation": "relu"}, "activation must be one of"),
    (lambda a: {**a, "x": a["x"][None]}, "x must have shape"),
    (lambda a: {**a, "x": a["x"].double()}, "x must be float32"),
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, "w13 must have shape"),
    (lambda a: {**a, "w13": a["w13"][..., :-1]}, "w13 must have shape"),
    (lambda a: {**a, "w2": a["w2"][:, :, :-1]}, "w2 must have shape"),
    (lambda a: {**a, "w2": a["w2"].bfloat16()}, "w2 must have the dtype of x"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, "topk_ids must have shape"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be int64 or int32"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights must have the shape"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].long()}, "topk_weights must be a float"),
    (lambda a: {**a, "w2": a["w2"].to("meta")}, "w2 must be on cpu"),
])
def test_bad_inputs_are_rejected(mutate: Any, message: str) -> None:
    args = mutate({**make_case(4, 16, 8, 3, 2), "activation": "silu"})
    for fn in (moe_grouped, moe_reference):
        with pytest.raises(ValueError, match=message):
            fn(**args)


@pytest.mark.parametrize("bad_id", [3, -1])
def test_expert_ids_out_of_range_are_rejected(bad_id: int) -> None:
    case = make_case(4, 16, 8, 3, 2)
    case["topk_ids"][2, 1] = bad_id
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 3\)"):
        moe_grouped(**case)
