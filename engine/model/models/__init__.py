"""The architectures served here: each model file turns its transformers config into the
`ArchOptions` the shared layers are built from (engine.model.arch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.model.arch import ArchOptions
from engine.model.models import gemma, llama, moe, phi3, qwen3

_BUILDERS: dict[str, Callable[[Any], ArchOptions]] = {
    **llama.ARCHITECTURES, **qwen3.ARCHITECTURES, **moe.ARCHITECTURES,
    **gemma.ARCHITECTURES, **phi3.ARCHITECTURES,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_BUILDERS))
# A config without `architectures` (built in code, or an old config.json): its model type's
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
}


def architecture_of(config: Any) -> str:
    """The config's first supported architecture; ValueError naming it otherwise."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[config.model_type]
    for name in names:
        if name in _BUILDERS:
            return name
    raise ValueError(
        f"unsupported model architecture {names or getattr(config, 'model_type', None)!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def options_for(config: Any) -> ArchOptions:
    """The `ArchOptions` of a transformers config of a supported architecture."""
    return _BUILDERS[architecture_of(config)](config)
