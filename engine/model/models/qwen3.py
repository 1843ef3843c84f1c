"""Qwen3: Llama's layout plus a per-head RMSNorm of q and k before RoPE, and an explicit
`head_dim` (hidden_size != heads * head_dim)."""

from __future__ import annotations

from typing import Any

from engine.model.arch import ArchOptions, base_options


def qwen3(config: Any) -> ArchOptions:
    return base_options(config, qk_norm=True)


ARCHITECTURES = {"Qwen3ForCausalLM": qwen3}
