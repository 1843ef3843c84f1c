"""Gemma 2 and Gemma 3 (text): GeGLU, (1 + w) RMSNorms in float32 before and after both the
attention and the MLP, embeddings scaled by sqrt(hidden_size), attention scaled by
`query_pre_attn_scalar ** -0.5`, alternating local (sliding-window) and global layers. Gemma 2
soft-caps attention scores and final logits; Gemma 3 norms q and k per head and gives local and
global layers their own RoPE base (`rope_parameters` per layer type, 5 local : 1 global)."""

from __future__ import annotations

from typing import Any

from engine.model.arch import ArchOptions, base_options


def _common(config: Any, **overrides: Any) -> ArchOptions:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
    return base_options(
        config, gemma_norms=True, embed_scale=float(config.hidden_size) ** 0.5,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None), **overrides)


def gemma2(config: Any) -> ArchOptions:
    return _common(config)


def gemma3(config: Any) -> ArchOptions:
    return _common(config, qk_norm=True)


ARCHITECTURES = {"Gemma2ForCausalLM": gemma2, "Gemma3ForCausalLM": gemma3}
