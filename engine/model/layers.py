"""Building blocks of the Llama-family decoder: RMSNorm, attention with fused QKV, SwiGLU MLP.

Parameters are created uninitialised (`torch.empty`); `LlamaForCausalLM.load_weights` fills
them from a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.linear import linear
from engine.model.rope import RotaryEmbedding


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _bias(size: int, enabled: bool, dtype: torch.dtype) -> nn.Parameter | None:
    return _param(size, dtype=dtype) if enabled else None


def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else hidden_size // num_attention_heads (as transformers)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """Self-attention with one fused q/k/v projection; K/V go through the paged cache."""

    def __init__(self, config: Any, rope: RotaryEmbedding, backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.qkv_weight = _param(q_size + 2 * kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = _bias(q_size + 2 * kv_size, qkv_bias, dtype)
        self.o_weight = _param(config.hidden_size, q_size, dtype=dtype)
        self.o_bias = _bias(config.hidden_size, o_bias, dtype)
        self.rope = rope
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [n, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, -1)
        qk = self.rope(positions, qk)  # [n, num_heads + num_kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return linear(out.reshape(n, self.q_size), self.o_weight, self.o_bias)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.intermediate_size = inter
        self.gate_up_weight = _param(2 * inter, config.hidden_size, dtype=dtype)
        self.gate_up_bias = _bias(2 * inter, bias, dtype)
        self.down_weight = _param(config.hidden_size, inter, dtype=dtype)
        self.down_bias = _bias(config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # [n, 2 * inter]
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return linear(F.silu(gate).mul_(up), self.down_weight, self.down_bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, rope: RotaryEmbedding, backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = Attention(config, rope, backend, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))
