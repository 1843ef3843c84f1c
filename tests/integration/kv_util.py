"""KV cache sizes for tests that set `num_kv_blocks`: a hybrid model's block is a page of fewer
layers, one KV cache group's (engine/core/kv_layout.py)."""

from __future__ import annotations

from pathlib import Path


def kv_groups(model_dir: Path) -> int:
    """How many KV cache groups the engine gives the model (1 unless it is hybrid)."""
    from transformers import AutoConfig

    from engine.core.kv_layout import make_layout
    from engine.model.models import options_for

    return make_layout(options_for(AutoConfig.from_pretrained(model_dir)).windows, True).num_groups


def pages_like(model_dir: Path, num_kv_blocks: int) -> int:
    """`num_kv_blocks` for this model that give each KV cache group as many pages as a
    one-group model gets blocks (so it preempts alike)."""
    return 1 + (num_kv_blocks - 1) * kv_groups(model_dir)
