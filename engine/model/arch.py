"""What a decoder-only architecture is made of, read from its transformers config.

Every model served here is one stack of the same parts (engine.model.layers): token embedding,
N x (attention + gated MLP or mixture of experts), a final norm and the LM head. What differs
between Llama, Qwen, Mistral, Mixtral, Gemma and Phi is a handful of switches and numbers,
gathered in `ArchOptions`; each model file (engine/model/models/) turns its config into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.model.rope import rope_parameters

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoeOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    shared_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    shared_expert_gate: bool = False  # sigmoid(x @ w) scales the shared expert's output


@dataclass(frozen=True)
class ArchOptions:
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    tie_word_embeddings: bool
    windows: tuple[int | None, ...]  # per layer: sliding window (keys seen), None = global
    rope_layer_types: tuple[str | None, ...]  # per layer: key of its RoPE settings (Gemma 3)
    moe_layers: tuple[bool, ...] = ()  # per layer: mixture of experts instead of the dense MLP
    moe: MoeOptions | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + w) RMSNorm in float32; norms after attention and MLP too
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else hidden_size // num_attention_heads (as transformers)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def activation_of(config: Any) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported "
                         f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies it: the layers that
    `config.layer_types` calls "sliding_attention" where the config has layer types (Qwen2/3,
    Gemma 2/3), else every layer when `sliding_window` is set (Mistral, Mixtral, Phi-3,
    Qwen3-MoE)."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported")
        if len(types) != n:
            raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    if window is None:
        return (None,) * n
    if types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * n


def rope_layer_types(config: Any) -> tuple[str | None, ...]:
    """Per layer, the key of its RoPE settings where the config keeps them per layer type."""
    n = int(config.num_hidden_layers)
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        types = list(config.layer_types)
        for t in set(types):
            rope_parameters(config, t)  # raises for a type without settings
        return tuple(types)
    return (None,) * n


def base_options(config: Any, **overrides: Any) -> ArchOptions:
    """The options every architecture shares, from the standard config fields."""
    n = int(config.num_hidden_layers)
    fields: dict[str, Any] = dict(
        num_layers=n,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=head_dim_of(config),
        intermediate_size=int(config.intermediate_size),
        norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        activation=activation_of(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        windows=layer_windows(config),
        rope_layer_types=rope_layer_types(config),
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    fields.update(overrides)
    return ArchOptions(**fields)


def moe_layer_flags(config: Any) -> tuple[bool, ...]:
    """Qwen-MoE's rule: layer i is sparse unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers))
