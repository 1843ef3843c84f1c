"""Rotary position embedding (the "rotate half" / NeoX form of every model served here).

Reads the RoPE settings of a transformers 5 config (`config.rope_parameters`: `rope_theta`,
`rope_type` and the type's own keys; Gemma 3 keeps one such dict per layer type) and
precomputes a cos/sin table for every position up to `max_position_embeddings` (positions must
stay below it). Supported types: `default`, `linear`, `dynamic` (its frequencies at
initialisation, i.e. exact within `max_position_embeddings`), `llama3`, `yarn`, `longrope`.
`partial_rotary_factor` < 1 (Phi-4-mini) rotates the first part of each head only.

LongRoPE (Phi-3/4) has two frequency sets: transformers uses the long one for a whole forward
once its largest position reaches `original_max_position_embeddings`, the short one before.
Here a request's tokens of a step use the long set when the request's context after the step
is longer than that (`long_tokens`), which is what transformers' forward computes for a whole
prompt and, with its KV cache, token by token. A prompt split into chunks across that length is
rotated per chunk, and tokens cached before the switch keep their rotation (transformers'
`generate` for Phi-3 instead recomputes the whole sequence at the switch; vLLM does not either).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels.cpu import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings (for `layer_type` where they are kept per layer type) as one
    dict with at least `rope_theta` and `rope_type`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if params and all(isinstance(v, dict) for v in params.values()):  # one dict per layer type
        if layer_type not in params:
            raise ValueError(f"no RoPE parameters for layer type {layer_type!r}: {sorted(params)}")
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
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


def _longrope(base: float, dim: int, p: dict[str, Any], max_pos: int,
              long: bool) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**exponents), float(attention_factor)


def rotary_dim(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dims of each head are rotated (`head_dim * partial_rotary_factor`)."""
    return int(head_dim * float(rope_parameters(config, layer_type)["partial_rotary_factor"]))


def inv_freq_and_scaling(config: Any, head_dim: int, layer_type: str | None = None,
                         long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim / 2]` float32 and the cos/sin scaling factor (`long`:
    LongRoPE's long-context set)."""
    p = rope_parameters(config, layer_type)
    rope_type, base = p["rope_type"], float(p["rope_theta"])
    head_dim = rotary_dim(config, head_dim, layer_type)
    inv_freq = _default_inv_freq(base, head_dim)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope_type == "yarn":
        return _yarn(base, head_dim, p, config.max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(base, head_dim, p, config.max_position_embeddings, long)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads given each token's position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: Any, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(config, head_dim, layer_type)
        params = rope_parameters(config, layer_type)
        cos, sin = self._table(config, layer_type, max_positions, long=False)
        # LongRoPE: the long set's rows follow the short set's in one table
        self.long_after: int | None = None
        if params["rope_type"] == "longrope":
            self.long_after = int(params["original_max_position_embeddings"])
            cos_long, sin_long = self._table(config, layer_type, max_positions, long=True)
            cos, sin = torch.cat((cos, cos_long)), torch.cat((sin, sin_long))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.num_positions = max_positions

    def _table(self, config: Any, layer_type: str | None, num_positions: int,
               long: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = inv_freq_and_scaling(config, self.head_dim, layer_type, long)
        pos = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [num_positions, rotary_dim / 2]
        return freqs.cos() * scaling, freqs.sin() * scaling

    def long_tokens(self, positions: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                    pure_decode: bool) -> torch.Tensor | None:
        """LongRoPE only: `[num_tokens]` bool, True where a token takes the long set (its
        request's context after this step is longer than `original_max_position_embeddings`);
        None for other RoPE types."""
        if self.long_after is None:
            return None
        if pure_decode:  # one token a request: its context is its position + 1
            return positions >= self.long_after
        per_req = torch.tensor([s > self.long_after for s in seq_lens], device=positions.device)
        return per_req.repeat_interleave(
            torch.tensor(query_lens, device=positions.device), output_size=positions.shape[0])

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        long_tokens: torch.Tensor | None = None,  # [num_tokens] bool, LongRoPE only
    ) -> torch.Tensor:
        """Returns the rotated `x`: bf16 on the CPU is rotated in place by one fused C call
        (kernels/cpu/fused_ops.c, the same bits as the code below), others get a new tensor."""
        rows = positions if long_tokens is None else positions + long_tokens * self.num_positions
        if fused_ops.rotary_applies(x, self.cos, self.rotary_dim):
            return fused_ops.rotary_(x, self.cos, self.sin, rows, self.rotary_dim)
        cos = self.cos[rows].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, rotary_dim / 2]
        sin = self.sin[rows].unsqueeze(1).to(x.dtype)
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if self.rotary_dim == self.head_dim:
            return torch.cat(rotated, dim=-1)
        return torch.cat((*rotated, x[..., self.rotary_dim :]), dim=-1)
