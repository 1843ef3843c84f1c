"""Llama-family causal LM (Llama, Qwen2, Mistral) over a paged KV cache.

The model takes the flattened tokens of one varlen batch (`input_ids`, `positions`), one KV
cache tensor per layer and the step's `AttentionMetadata`; it returns the final-normed hidden
states of every token. The runner picks the rows it needs and calls `compute_logits`.
Mistral's sliding window is not applied (exact for contexts up to `sliding_window`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.layers import DecoderLayer, RMSNorm, _param, head_dim_of
from engine.model.linear import linear
from engine.model.rope import RotaryEmbedding

LayerHook = Callable[[int], None]

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our name inside the layer, which part of a fused tensor)
_FUSED: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attn.qkv", "q"),
    "self_attn.k_proj": ("self_attn.qkv", "k"),
    "self_attn.v_proj": ("self_attn.qkv", "v"),
    "self_attn.o_proj": ("self_attn.o", ""),
    "mlp.gate_proj": ("mlp.gate_up", "gate"),
    "mlp.up_proj": ("mlp.gate_up", "up"),
    "mlp.down_proj": ("mlp.down", ""),
}


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer with RMSNorm, RoPE, GQA and a SwiGLU MLP."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        hidden = hf_config.hidden_size
        self.embed_tokens = _param(hf_config.vocab_size, hidden, dtype=dtype)
        rope = RotaryEmbedding(hf_config, head_dim_of(hf_config), hf_config.max_position_embeddings)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, rope, attn_backend, dtype)
            for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else _param(
            hf_config.vocab_size, hidden, dtype=dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        before_layer: LayerHook | None = None,
        after_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """Runs all layers (writing each layer's new K/V into its cache); returns the
        final-normed hidden states `[num_tokens, hidden]`. `before_layer(i)` / `after_layer(i)`
        are called around layer `i` (e.g. a KV connector waiting for a layer's load, or
        saving a layer's KV as soon as it is written)."""
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(positions, x, kv_caches[i], metadata)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> float32 logits `[n, vocab_size]`."""
        return linear(hidden, self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors (`model.layers.0.self_attn.q_proj.weight`, ...)
        into the (fused) parameters. Raises ValueError for unknown names, wrong shapes, or
        parameters the checkpoint leaves unset."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: dict[str, int] = {}  # parameter name -> rows set so far
        for hf_name, tensor in weights:
            target = self._map_name(hf_name)
            if target is None:
                continue
            name, rows = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            dst = params[name].data if rows is None else params[name].data[rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor.to(self.dtype))
            loaded[name] = loaded.get(name, 0) + dst.shape[0]
        self._check_complete(params, loaded)

    def _map_name(self, hf_name: str) -> tuple[str, slice | None] | None:
        """HF tensor name -> (our parameter name, rows of a fused parameter), None = skip."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else ("lm_head", None)
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        match = _LAYER_NAME.match(name)
        if match is None:
            return name, None
        layer, rest = match.groups()
        module, _, kind = rest.rpartition(".")
        if module not in _FUSED:
            return f"layers.{layer}.{rest}", None
        ours, part = _FUSED[module]
        full = f"layers.{layer}.{ours}_{kind}"
        return full, self._fused_rows(part)

    def _fused_rows(self, part: str) -> slice | None:
        cfg = self.config
        inter = int(cfg.intermediate_size)
        q = cfg.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
                "gate": slice(0, inter), "up": slice(inter, 2 * inter)}
        return rows.get(part)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: dict[str, int]) -> None:
        missing = [
            name for name, param in params.items()
            if loaded.get(name, 0) < param.shape[0]
            and not (name == "lm_head" and self.tie_word_embeddings)
        ]
        if missing:
            raise ValueError(f"checkpoint does not set parameters: {missing}")
