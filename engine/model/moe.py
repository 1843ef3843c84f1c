"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts; each expert is a gated MLP; Qwen2-MoE adds an always-on shared expert scaled by
a sigmoid gate.

Routing as transformers does it: softmax over the router logits in float32, top-k, and (where
`norm_topk_prob`, always for Mixtral) the k weights renormalised to sum to 1. The experts run
grouped by expert, never token by token: `kernels.moe.moe_grouped` on the CPU (one pair of GEMMs
per expert that received tokens), the Triton fused-MoE kernel on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import ArchOptions
from engine.model.mlp import GatedMLP, param
from kernels.moe import moe_grouped

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallel


class SparseMoE(nn.Module):
    """Under tensor parallelism (`tp`), every expert's intermediate slice of this rank (and the
    shared expert's): the partial outputs are summed over the ranks once, at the end."""

    def __init__(self, opts: ArchOptions, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        moe = opts.moe
        if moe is None:
            raise ValueError("a sparse MoE layer needs the config's MoE options")
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.activation = opts.activation
        hidden, inter = opts.hidden_size, moe.intermediate_size
        self.router_weight = param(moe.num_experts, hidden, dtype=dtype)
        self.w13 = param(moe.num_experts, 2 * inter, hidden, dtype=dtype)  # gate rows, then up
        self.w2 = param(moe.num_experts, hidden, inter, dtype=dtype)
        self.shared: GatedMLP | None = None
        self.shared_gate_weight: nn.Parameter | None = None
        if moe.shared_intermediate_size:
            self.shared = GatedMLP(hidden, moe.shared_intermediate_size, opts.activation, False, dtype)
            if moe.shared_expert_gate:
                self.shared_gate_weight = param(1, hidden, dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[n, hidden]` -> (top-k weights `[n, k]` float32, expert ids `[n, k]` int64)."""
        probs = F.linear(x, self.router_weight).float().softmax(dim=-1)  # [n, num_experts]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = self.route(x)
        if x.is_cuda:
            from kernels.triton.fused_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids, self.activation)
        else:
            out = moe_grouped(x, self.w13, self.w2, weights, ids, self.activation)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate_weight is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out)
