"""Llama 2/3.x (every `rope_type`), Mistral (with its sliding window) and Qwen2 (q/k/v bias)."""

from __future__ import annotations

from typing import Any

from engine.model.arch import ArchOptions, base_options


def llama(config: Any) -> ArchOptions:
    return base_options(config)


def qwen2(config: Any) -> ArchOptions:
    return base_options(config, qkv_bias=True, o_bias=False)


ARCHITECTURES = {"LlamaForCausalLM": llama, "MistralForCausalLM": llama,
                 "Qwen2ForCausalLM": qwen2}
