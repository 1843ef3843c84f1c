"""The gated MLP (SwiGLU / GeGLU) and the parameter helpers the model parts share.

Parameters are created uninitialised (`torch.empty`); `CausalLM.load_weights` fills them from a
checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.linear import linear, row_parallel_linear
from kernels.cpu import fused_ops

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallel

ACTIVATIONS = ("silu", "gelu_tanh")


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def bias(size: int, enabled: bool, dtype: torch.dtype) -> nn.Parameter | None:
    return param(size, dtype=dtype) if enabled else None


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` for SwiGLU ("silu") and GeGLU ("gelu_tanh"); may reuse `gate`."""
    if activation == "silu":
        if fused_ops.silu_and_mul_applies(gate, up):  # bf16 on the CPU: one C call
            return fused_ops.silu_and_mul(gate, up)
        return F.silu(gate).mul_(up)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh").mul_(up)
    raise ValueError(f"activation {activation!r} is not supported (supported: {ACTIVATIONS})")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (SwiGLU / GeGLU).
    Under tensor parallelism `inter` is this rank's slice and `tp` sums `down` over the ranks
    (None: the caller sums a partial output itself, as the MoE's shared expert)."""

    def __init__(self, hidden: int, inter: int, activation: str, with_bias: bool,
                 dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = inter
        self.activation = activation
        self.gate_up_weight = param(2 * inter, hidden, dtype=dtype)
        self.gate_up_bias = bias(2 * inter, with_bias, dtype)
        self.down_weight = param(hidden, inter, dtype=dtype)
        self.down_bias = bias(hidden, with_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # [n, 2 * inter]
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return row_parallel_linear(act_and_mul(gate, up, self.activation), self.down_weight,
                                   self.down_bias, self.tp)
