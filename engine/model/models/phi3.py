"""Phi-3 / Phi-3.5 / Phi-4-mini: q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`), LongRoPE, and (Phi-4-mini) `partial_rotary_factor` < 1: only the
first part of each head is rotated. Phi-3-mini's `sliding_window` covers every layer."""

from __future__ import annotations

from typing import Any

from engine.model.arch import ArchOptions, base_options


def phi3(config: Any) -> ArchOptions:
    return base_options(config)


ARCHITECTURES = {"Phi3ForCausalLM": phi3}
