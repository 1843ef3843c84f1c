"""Triton fused mixture-of-experts feed-forward for CUDA, with the contract of
`kernels.moe.moe_reference` (the reference it is tested against).

Design (the grouped-GEMM layout of vLLM's fused_moe, written for this project):
1. `moe_align_block_size` sorts the P = T*K (token, choice) pairs by expert and lays them out in
   blocks of BLOCK_M slots, each expert's run padded up to a whole number of blocks, so that every
   block belongs to one expert. Padding slots hold the sentinel P. It uses only device ops with
   shapes known on the host (no host sync, CUDA-graph capturable): the grid is sized for the worst
   case of P + min(E, P) * (BLOCK_M - 1) slots and programs past the real end exit at once.
2. GEMM 1 (w13, with the activation fused into its epilogue): a program owns one block of pairs
   and BLOCK_N intermediate columns. It gathers the pairs' token rows of x, multiplies them by its
   expert's gate rows and up rows (two fp32 accumulators over the same x tile) and writes
   `act(gate) * up` for its columns to `inter` [P, I] at the pairs' own rows.
3. GEMM 2 (w2): same blocks, `inter` rows times the expert's down projection, each row scaled by
   its routing weight in fp32, written to `partial` [P, H] at row p = t*K + j.
4. out[t] = sum_j partial[t*K + j], summed in fp32 by torch (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import check_moe_inputs
from kernels.triton._checks import (
    check_contiguous,
    check_rows_contiguous,
    interpreter_enabled,
    require_cuda_or_interpreter,
)
from kernels.triton.tl_math import dot

_ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert into blocks of `block_m` slots, each expert padded to whole blocks.

    topk_ids [T, K] int; pair p = t*K + j. Returns
    - sorted_pair_ids [num_blocks * block_m] int32: the pair in each slot, P = T*K for padding;
    - block_expert_ids [num_blocks] int32: the expert of each block (clamped into range past the
      used blocks, whose programs exit before reading it);
    - num_padded [1] int32: slots in use (a multiple of block_m), on the device.
    num_blocks = cdiv(P + min(E, P) * (block_m - 1), block_m), an upper bound known on the host."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; no host sync unlike bincount
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    expert_of = flat.index_select(0, order)  # [P] nondecreasing
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank  # [P] slot of each sorted pair
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = block_expert_ids.clamp_(max=max(num_experts - 1, 0)).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(
        1, dtype=torch.int32, device=device)
    return sorted_pair_ids, block_expert_ids, num_padded


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *, block_m: int | None = None,
              block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> torch.Tensor:
    """Same result as `moe_reference`; returns a new [T, H] tensor in x.dtype.

    x [T, H] (rows contiguous), w13 [E, 2*I, H] and w2 [E, H, I] contiguous in x.dtype,
    topk_weights [T, K] float, topk_ids [T, K] int32/int64 in [0, E) (not checked: no host sync).
    fp32 inputs multiply in IEEE fp32 (no TF32); fp16/bf16 accumulate in fp32 and round `inter`
    and the weighted per-pair outputs to x.dtype before the fp32 sum over K.
    Tuning knobs (keyword-only): block_m pairs per block, block_n output columns and block_k
    reduction step (powers of two >= 16); defaults from `_default_config`."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, activation)
    require_cuda_or_interpreter(x, "x")
    check_rows_contiguous("x", x)
    check_contiguous("w13", w13)
    check_contiguous("w2", w2)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or hidden == 0 or inter == 0:
        return torch.zeros_like(x)
    config = _default_config(x.dtype, num_pairs, num_experts)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value is not None:
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
            config[name] = value
    if num_warps is not None:
        config["num_warps"] = num_warps
    if num_stages is not None:
        config["num_stages"] = num_stages
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]

    sorted_pair_ids, block_expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, bm)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    inter_act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    partial = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)  # [P, H]
    num_blocks = block_expert_ids.shape[0]
    common = dict(
        IEEE=x.dtype == torch.float32, UPCAST=x.dtype == torch.bfloat16 and interpreter_enabled(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    _moe_gemm_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w13, inter_act, weights, sorted_pair_ids, block_expert_ids, num_padded,
        inter, hidden, num_pairs,
        x.stride(0), w13.stride(0), w13.stride(1), inter_act.stride(0), inter * w13.stride(1),
        A_ROW_DIV=top_k, GATED=True, ACTIVATION=_ACTIVATION_CODES[activation], MUL_WEIGHT=False,
        **common,
    )
    _moe_gemm_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        inter_act, w2, partial, weights, sorted_pair_ids, block_expert_ids, num_padded,
        hidden, inter, num_pairs,
        inter_act.stride(0), w2.stride(0), w2.stride(1), partial.stride(0), 0,
        A_ROW_DIV=1, GATED=False, ACTIVATION=0, MUL_WEIGHT=True,
        **common,
    )
    if top_k == 1:
        return partial
    return partial.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def _default_config(dtype: torch.dtype, num_pairs: int, num_experts: int) -> dict[str, int]:
    """Tiles by the mean rows per expert (padding waste vs. weight reuse). Not tuned on a GPU yet:
    the sizes follow the usual fused-MoE defaults (16-row blocks for decode-sized batches)."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    if dtype == torch.float32:  # exactness checks, not speed
        return {"block_m": min(block_m, 32), "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    return {"block_m": block_m, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_a_row, stride_w_expert, stride_w_row, stride_c_row, up_offset,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """c[p, n] = (a[p // A_ROW_DIV] @ w[e, n]^T) for the pairs p of one block of expert e and BLOCK_N
    columns n < N, reducing over K. GATED: also the up rows `w[e, n] + up_offset`, and
    c = act(gate) * up. MUL_WEIGHT: c[p] *= topk_weights[p]. a [*, K], w [E, *, K], c [P, N];
    the last dimension of each is contiguous."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (w_ptr + expert * stride_w_expert + offs_n[None, :].to(tl.int64) * stride_w_row
              + offs_k[:, None])  # [BLOCK_K, BLOCK_N]: w[e, n, k] read transposed
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot(a, w, acc, IEEE, UPCAST)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = dot(a, w_up, acc_up, IEEE, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        if ACTIVATION == 0:  # silu
            acc = acc * tl.sigmoid(acc)
        else:  # gelu tanh: 0.5 * g * (1 + tanh(z)) = g * sigmoid(2 z)
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc * tl.sigmoid(2.0 * z)
        acc = acc * acc_up
    if MUL_WEIGHT:
        routing = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * routing[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_c_row + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
