"""The default model, SmolLM2-135M-Instruct: the catalog's first entry (engine/model/sources/catalog.py).

`ensure_default_model()` returns `<cache>/models/smollm2-135m-instruct` (cache: `$PDSERVE_CACHE_DIR`
or `~/.cache/pdserve`) holding config.json, model.safetensors (float32, dequantized) and the
tokenizer files (chat template included), converted on first use (about 20 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

from engine.model.sources.catalog import DEFAULT_MODEL_NAME, SMOLLM2, ensure_model, model_dir
from engine.model.sources.model_cache import cache_dir

__all__ = ["DEFAULT_MODEL_ALIASES", "DEFAULT_MODEL_NAME", "cache_dir", "default_model_dir",
           "ensure_default_model", "is_default_model"]

DEFAULT_MODEL_ALIASES = (SMOLLM2.name, *SMOLLM2.aliases)


def is_default_model(name: str) -> bool:
    """True for the default model's short name or hub id (case-insensitive)."""
    return name.strip().lower() in DEFAULT_MODEL_ALIASES


def default_model_dir() -> Path:
    return model_dir(SMOLLM2)


def ensure_default_model() -> Path:
    """The converted default model folder, converting the GGUF file on first use."""
    return ensure_model(SMOLLM2)
