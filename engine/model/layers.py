"""Building blocks of every decoder served here: RMSNorm, attention with a fused QKV projection
and the decoder layer (its MLP dense, engine.model.mlp, or sparse, engine.model.moe),
configured by `ArchOptions`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.arch import ArchOptions
from engine.model.linear import linear, row_parallel_linear
from engine.model.mlp import GatedMLP, bias, param
from engine.model.moe import SparseMoE
from engine.model.rope import RotaryEmbedding
from kernels.cpu import fused_ops

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallel


class RMSNorm(nn.Module):
    """`x / rms(x) * w`; `gemma=True`: `* (1 + w)`, all in float32, then cast (Gemma's norm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, gemma: bool = False) -> None:
        super().__init__()
        self.weight = param(size, dtype=dtype)
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            xf = x.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        rows = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x
        if fused_ops.norm_applies(rows, self.weight):  # bf16 on the CPU: one fused C call
            return fused_ops.add_rms_norm(rows, None, self.weight, self.eps)[1].view(x.shape)
        return fused_ops.rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + add, self(x + add))` for [tokens, size] inputs: the residual stream and its norm,
        in one fused C call for bf16 on the CPU."""
        if not self.gemma and x.dtype != torch.float32 and fused_ops.norm_applies(x, self.weight):
            total, normed = fused_ops.add_rms_norm(x, add, self.weight, self.eps)
            assert total is not None
            return total, normed
        total = x + add
        return total, self._normalize(total)


class Attention(nn.Module):
    """Self-attention with one fused q/k/v projection; K/V go through the paged cache. Optional:
    per-head q/k norms, a sliding window, logit soft-capping, a custom scale. Under tensor
    parallelism `opts` holds this rank's heads (engine/parallel/shard.py) and `tp` sums the
    output projection over the ranks."""

    def __init__(self, opts: ArchOptions, layer: int, rope: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = opts.num_heads, opts.num_kv_heads
        self.head_dim = opts.head_dim
        self.scale = opts.scale
        self.window = opts.windows[layer]
        self.softcap = opts.attn_softcap
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_weight = param(q_size + 2 * kv_size, opts.hidden_size, dtype=dtype)
        self.qkv_bias = bias(q_size + 2 * kv_size, opts.qkv_bias, dtype)
        self.o_weight = param(opts.hidden_size, q_size, dtype=dtype)
        self.o_bias = bias(opts.hidden_size, opts.o_bias, dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, opts.norm_eps, dtype, opts.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, opts.norm_eps, dtype, opts.gemma_norms)
        self.rope = rope
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        long_tokens: torch.Tensor | None = None,  # [num_tokens] bool, LongRoPE only
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [n, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, -1)
            qk = self.rope(positions, qk, long_tokens)  # [n, num_heads + num_kv_heads, head_dim]
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size]
                            .view(n, self.num_kv_heads, self.head_dim))
            q, k = self.rope(positions, q, long_tokens), self.rope(positions, k, long_tokens)
        if self.window is None and self.softcap is None:
            out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale,
                                       sliding_window=self.window, logits_soft_cap=self.softcap)
        return row_parallel_linear(out.reshape(n, self.q_size), self.o_weight, self.o_bias, self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm residual block; with Gemma's norms the attention and MLP outputs are normed
    too before they join the residual stream."""

    def __init__(self, opts: ArchOptions, layer: int, rope: RotaryEmbedding,
                 backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(opts.hidden_size, opts.norm_eps, dtype, opts.gemma_norms)

        self.input_layernorm = norm()
        self.self_attn = Attention(opts, layer, rope, backend, dtype, tp)
        self.post_attention_layernorm = norm()
        self.mlp: nn.Module = (
            SparseMoE(opts, dtype, tp) if opts.is_moe(layer)
            else GatedMLP(opts.hidden_size, opts.intermediate_size, opts.activation,
                          opts.mlp_bias, dtype, tp))
        self.gemma_norms = opts.gemma_norms
        if opts.gemma_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]: the stream, or the last layer's MLP output
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        long_tokens: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,  # the stream before `x` is added to it
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(mlp_out, residual)`: the residual stream after this layer is `residual + mlp_out`,
        left for the next layer's input norm (or the final norm) to add in the same fused call,
        as vLLM's layers do (one op less per layer; the same sum, rounded the same way).
        With Gemma's norms the layer adds it itself and returns `(stream, None)`."""
        if not self.gemma_norms:
            if residual is None:
                residual, normed = x, self.input_layernorm(x)
            else:
                residual, normed = self.input_layernorm.add_and_norm(residual, x)
            attn = self.self_attn(positions, normed, kv_cache, metadata, long_tokens)
            residual, normed = self.post_attention_layernorm.add_and_norm(residual, attn)
            return self.mlp(normed), residual
        if residual is not None:
            x = residual + x
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, metadata, long_tokens)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
