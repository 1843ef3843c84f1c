"""Rotary position embedding (the "rotate half" / NeoX form used by Llama, Qwen2, Mistral).

Reads the RoPE settings of a transformers 5 config (`config.rope_parameters`: `rope_theta`,
`rope_type` and the type's own keys) and precomputes a cos/sin table for every position up to
`max_position_embeddings` (positions must stay below it). Supported types: `default`, `linear`, `dynamic`
(its frequencies at initialisation, i.e. exact within `max_position_embeddings`), `llama3`,
`yarn`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least `rope_theta` and `rope_type`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2]


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def inv_freq_and_scaling(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` float32 and the cos/sin scaling factor."""
    p = rope_parameters(config)
    rope_type, base = p["rope_type"], float(p["rope_theta"])
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    inv_freq = _default_inv_freq(base, head_dim)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope_type == "yarn":
        return _yarn(base, head_dim, p, config.max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads given each token's position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq, self.scaling = inv_freq_and_scaling(config, head_dim)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _build(self, num_positions: int) -> None:
        pos = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # [num_positions, head_dim / 2]
        self.cos = freqs.cos() * self.scaling
        self.sin = freqs.sin() * self.scaling

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:
        """Returns the rotated `x` (a new tensor of the same shape and dtype)."""
        half = self.head_dim // 2
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
