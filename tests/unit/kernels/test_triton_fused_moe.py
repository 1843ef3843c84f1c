"""The Triton fused-MoE kernel equals `moe_reference`.

Runs in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA) and on the GPU when one is present. Tolerances against the float32 reference computed from
the same inputs: float32 2e-5 (IEEE fp32 dot); float16 1e-2 and bfloat16 4e-2 (the intermediate
activations and the weighted per-pair outputs are rounded to the input dtype).
Shapes are tiny and tiles forced small so that the default run stays at a few seconds in the
interpreter while still covering several row blocks, column blocks and reduction steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.moe import ACTIVATIONS, moe_grouped, moe_reference
from kernels.triton.fused_moe import fused_moe, moe_align_block_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


def make_case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
              dtype: torch.dtype = torch.float32, seed: int = 0, ids: torch.Tensor | None = None,
              device: str = DEVICE) -> dict[str, Any]:
    """Weights scaled by 1/sqrt(fan_in) (outputs O(1)); distinct random experts per token unless
    `ids` is given; routing weights float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    if ids is None:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(ids.shape, generator=g)
    return {"x": x.to(device, dtype), "w13": w13.to(device, dtype), "w2": w2.to(device, dtype),
            "topk_weights": weights.to(device), "topk_ids": ids.to(device)}


def assert_fused_matches(case: dict[str, Any], activation: str = "silu", small_tiles: bool = False,
                         ) -> None:
    cpu = {k: v.cpu() for k, v in case.items()}
    want = moe_reference(**cpu, activation=activation)
    tile = 16 if small_tiles else None
    got = fused_moe(**case, activation=activation, block_m=tile, block_n=tile, block_k=tile)
    assert got.dtype == case["x"].dtype and got.shape == case["x"].shape
    atol, rtol = TOL[case["x"].dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_equals_reference(dtype: torch.dtype, activation: str) -> None:
    """H=40, I=24 with 16-wide tiles: ragged column blocks and reduction steps; 21 tokens x 3
    choices over 6 experts: several row blocks per expert, none full."""
    assert_fused_matches(make_case(21, 40, 24, 6, 3, dtype), activation, small_tiles=True)


@pytest.mark.parametrize("name, num_tokens, num_experts, top_k, ids", [
    ("experts without tokens", 6, 8, 2, torch.tensor([[1, 5], [5, 1], [1, 6], [6, 5], [1, 5], [5, 6]])),
    ("all tokens to one expert", 35, 4, 1, torch.full((35, 1), 3)),
    ("repeated expert in a row", 5, 4, 2, torch.full((5, 2), 0)),
    ("k=1", 11, 6, 1, None),
    ("t=1", 1, 16, 4, None),
    ("t=1, k=1, last expert", 1, 16, 1, torch.tensor([[15]])),
    ("int32 ids", 9, 5, 2, torch.tensor([[0, 4]] * 9, dtype=torch.int32)),
])
def test_routing_edge_cases(name: str, num_tokens: int, num_experts: int, top_k: int,
                            ids: torch.Tensor | None) -> None:
    assert_fused_matches(make_case(num_tokens, 24, 20, num_experts, top_k, ids=ids), small_tiles=True)


def test_default_tiles() -> None:
    assert_fused_matches(make_case(5, 48, 40, 4, 2, torch.bfloat16), "gelu_tanh")


def test_strided_x_and_bf16_routing_weights() -> None:
    case = make_case(7, 32, 16, 4, 2)
    case["x"] = torch.cat([case["x"], case["x"][:, :3]], dim=1)[:, :32]
    case["topk_weights"] = case["topk_weights"].bfloat16()
    assert_fused_matches(case, small_tiles=True)


def test_empty_batch_gives_empty_output() -> None:
    case = make_case(3, 16, 8, 3, 2, torch.bfloat16)
    case = {**case, "x": case["x"][:0], "topk_ids": case["topk_ids"][:0],
            "topk_weights": case["topk_weights"][:0]}
    out = fused_moe(**case)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_puts_every_pair_once_in_single_expert_blocks(block_m: int) -> None:
    ids = torch.tensor([[3, 0], [3, 2], [0, 3], [3, 2], [0, 0]])  # expert 1 empty, expert 0 thrice + dup
    num_pairs = ids.numel()
    sorted_ids, block_experts, num_padded = moe_align_block_size(ids.to(DEVICE), 4, block_m)
    sorted_ids, block_experts = sorted_ids.cpu().long(), block_experts.cpu().long()
    used = int(num_padded)
    assert used == block_m * 3  # experts 0, 2, 3 each fit in one block
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= used
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_ids[used:] == num_pairs).all()
    for b in range(used // block_m):
        pairs = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        assert pairs.numel() > 0
        assert (ids.reshape(-1)[pairs] == block_experts[b]).all()


def _args() -> dict[str, Any]:
    return make_case(4, 16, 8, 3, 2)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: {**a, "activation": "relu"}, "activation must be one of"),
    (lambda a: {**a, "w13": a["w13"].transpose(1, 2).contiguous().transpose(1, 2)}, "w13 must be contig"),
    (lambda a: {**a, "w2": a["w2"][:, :, :4]}, "w2 must have shape"),
    (lambda a: {**a, "x": a["x"].t().contiguous().t()}, "x must be contiguous within each row"),
    (lambda a: {**a, "block_m": 24}, "block_m must be a power of two"),
    (lambda a: {**a, "block_k": 8}, "block_k must be a power of two"),
])
def test_bad_inputs_are_rejected(mutate: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fused_moe(**mutate(_args()))


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        fused_moe(**make_case(4, 16, 8, 3, 2, device="cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_larger_batch_with_default_tiles(dtype: torch.dtype) -> None:
    """100 tokens x top-4 of 16 experts, H=160, I=96: default tiles, many blocks per expert."""
    for activation in ACTIVATIONS:
        assert_fused_matches(make_case(100, 160, 96, 16, 4, dtype, seed=1), activation)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_qwen3_moe_sized_layer_on_gpu(num_tokens: int) -> None:
    """Qwen3-30B-A3B's expert shapes (H=2048, I=768, 128 experts, top-8) in bfloat16 against
    `moe_grouped` on the same GPU inputs (the per-pair reference is too slow at this size)."""
    case = make_case(num_tokens, 2048, 768, 128, 8, torch.bfloat16, device="cuda")
    got = fused_moe(**case)
    want = moe_grouped(**case)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
