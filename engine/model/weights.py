"""Checkpoint tensor names -> our parameters: one table for every architecture served here.

Our layer parameters fuse what checkpoints keep apart: q/k/v into `self_attn.qkv_weight`,
gate/up into `mlp.gate_up_weight`, every expert's gate/up into one `[E, 2I, H]` tensor. A name maps
to (our parameter, the index of the part it fills). Both expert layouts load: one tensor per
expert (`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`, as
checkpoints on disk have them) and transformers 5's fused `mlp.experts.gate_up_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from engine.model.arch import ArchOptions

Index = Any  # a slice, an int, or a tuple of them (None: the whole parameter)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _rows(a: int, b: int) -> slice:
    return slice(a, b)


def _parts(opts: ArchOptions) -> dict[str, Callable[[], Index]]:
    q = opts.num_heads * opts.head_dim
    kv = opts.num_kv_heads * opts.head_dim
    inter = opts.intermediate_size
    shared = opts.moe.shared_intermediate_size if opts.moe else 0
    return {
        "q": lambda: _rows(0, q), "k": lambda: _rows(q, q + kv), "v": lambda: _rows(q + kv, q + 2 * kv),
        "gate": lambda: _rows(0, inter), "up": lambda: _rows(inter, 2 * inter),
        "shared_gate": lambda: _rows(0, shared), "shared_up": lambda: _rows(shared, 2 * shared),
    }


# HF module inside a layer -> (our module/parameter prefix, part of a fused tensor or "")
_IN_LAYER: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attn.qkv", "q"),
    "self_attn.k_proj": ("self_attn.qkv", "k"),
    "self_attn.v_proj": ("self_attn.qkv", "v"),
    "self_attn.qkv_proj": ("self_attn.qkv", ""),  # Phi-3: already fused, q|k|v
    "self_attn.o_proj": ("self_attn.o", ""),
    "mlp.gate_proj": ("mlp.gate_up", "gate"),
    "mlp.up_proj": ("mlp.gate_up", "up"),
    "mlp.gate_up_proj": ("mlp.gate_up", ""),  # Phi-3: already fused, gate|up
    "mlp.down_proj": ("mlp.down", ""),
    "mlp.shared_expert.gate_proj": ("mlp.shared.gate_up", "shared_gate"),
    "mlp.shared_expert.up_proj": ("mlp.shared.gate_up", "shared_up"),
    "mlp.shared_expert.down_proj": ("mlp.shared.down", ""),
}
# Whole parameters with another name inside a layer
_RENAMED = {
    "mlp.gate.weight": "mlp.router_weight",
    "block_sparse_moe.gate.weight": "mlp.router_weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_gate_weight",
    "mlp.experts.gate_up_proj": "mlp.w13",
    "mlp.experts.down_proj": "mlp.w2",
    "block_sparse_moe.experts.gate_up_proj": "mlp.w13",
    "block_sparse_moe.experts.down_proj": "mlp.w2",
}
# Per-expert tensors: HF projection -> (our parameter, which part of it)
_EXPERT_PARTS = {"gate_proj": ("w13", "gate"), "w1": ("w13", "gate"),
                 "up_proj": ("w13", "up"), "w3": ("w13", "up"),
                 "down_proj": ("w2", ""), "w2": ("w2", "")}


def map_name(hf_name: str, opts: ArchOptions) -> tuple[str, Index] | None:
    """HF tensor name -> (our parameter name, index into it or None), None = not a weight."""
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight":
        return None if opts.tie_word_embeddings else ("lm_head", None)
    if name == "embed_tokens.weight":
        return "embed_tokens", None
    match = _LAYER.match(name)
    if match is None:
        return name, None
    layer, rest = match.groups()
    prefix = f"layers.{layer}."
    if rest in _RENAMED:
        return prefix + _RENAMED[rest], None
    expert = _EXPERT.match(rest)
    if expert is not None:
        return _expert(prefix, int(expert.group(1)), expert.group(2), opts)
    module, _, kind = rest.rpartition(".")
    if module not in _IN_LAYER:
        return prefix + rest, None
    ours, part = _IN_LAYER[module]
    index = _parts(opts)[part]() if part else None
    return f"{prefix}{ours}_{kind}", index


def _expert(prefix: str, expert: int, proj: str, opts: ArchOptions) -> tuple[str, Index]:
    if proj not in _EXPERT_PARTS or opts.moe is None:
        raise ValueError(f"unknown expert tensor {proj!r} in {prefix}")
    ours, part = _EXPERT_PARTS[proj]
    inter = opts.moe.intermediate_size
    rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}.get(part)
    return f"{prefix}mlp.{ours}", (expert if rows is None else (expert, rows))
