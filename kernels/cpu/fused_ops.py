"""Fused CPU ops (fused_ops.c), next to their PyTorch references, which are the engine's own
code: bf16 RMSNorm (+ residual add), bf16 rotary embedding, bf16 SwiGLU's silu(gate) * up, and
the KV cache write (any dtype: a copy).

The C functions follow the references' roundings step by step, so they give the same bits
except that RMSNorm's float32 sum of squares is added in another order (at most two bf16 ulps,
on rare elements; the tests bound it). They exist because a decode step runs these ops on a
few dozen rows 150 times (default model), where PyTorch's per-op cost, 6-10 ops each, was
several times the arithmetic. bfloat16 only: float32 models keep the PyTorch ops, the path the
exactness tests hold to. `available()` says whether the library built (no C compiler, or
`PDSERVE_DISABLE_CPU_KERNELS=1`: the references serve).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu.build import LazyLibrary
from kernels.cpu.build import ptr as _ptr

_SOURCE = Path(__file__).with_name("fused_ops.c")
MAX_ROTARY_HALF = 512  # fused_ops.c's per-token table buffers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * bf16(x32 * rsqrt(mean(x32^2) + eps))` (transformers' Llama RMSNorm in bf16)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + add, rms_norm(x + add))`: the residual stream and its norm."""
    total = x + add
    return total, rms_norm_reference(total, weight, eps)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotary_dim: int) -> torch.Tensor:
    """NeoX rotary on `x [tokens, heads, head_dim]` with per-token float32 `cos`/`sin`
    `[tokens, rotary_dim / 2]` (rounded to x's dtype first); a new tensor."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if rotary_dim == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., rotary_dim:]), dim=-1)


def write_kv_reference(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Each token's K and V at its slot of `kv_cache [blocks, 2, block_size, kv_heads, d]`
    (`block * block_size + offset`; -1 skips the token)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices around a slice: the indexed view is [num_tokens, 2, kv_heads, head_dim].
    kv_cache[blocks, :, offsets] = torch.stack((key, value), dim=1).to(kv_cache.dtype)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def available() -> bool:
    return _load() is not None


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes this input (bf16 CPU rows with contiguous elements)."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.shape == (x.shape[1],) and available())


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`(x + add, rms_norm(x + add))`, or `(None, rms_norm(x))` without `add`; x and add are
    [rows, hidden] bf16 with contiguous rows (check `norm_applies` first)."""
    lib = _load()
    assert lib is not None and norm_applies(x, weight)
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    total = None
    if add is not None:
        if add.shape != x.shape or add.dtype != x.dtype or add.stride(1) != 1:
            raise ValueError("add must be bf16 rows of x's shape")
        total = torch.empty(rows, hidden, dtype=x.dtype)
    lib.add_rms_norm_bf16(
        _ptr(x), x.stride(0), _ptr(add) if add is not None else None,
        add.stride(0) if add is not None else 0, _ptr(total) if total is not None else None,
        _ptr(weight), _ptr(out), rows, hidden, ctypes.c_float(eps), torch.get_num_threads())
    return total, out


def rotary_applies(x: torch.Tensor, table: torch.Tensor, rotary_dim: int) -> bool:
    """Whether `rotary_` takes this input: bf16 CPU [tokens, heads, head_dim] with contiguous
    heads, float32 contiguous tables."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and table.dtype == torch.float32
            and table.is_contiguous() and rotary_dim % 2 == 0
            and rotary_dim // 2 <= MAX_ROTARY_HALF and available())


def rotary_(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, rows: torch.Tensor,
            rotary_dim: int) -> torch.Tensor:
    """Rotates `x` in place (and returns it) with table rows `rows` (int64, one per token):
    the same bits as `rotary_reference(x, cos_table[rows], sin_table[rows], rotary_dim)`."""
    lib = _load()
    assert lib is not None and rotary_applies(x, cos_table, rotary_dim)
    rows = rows.to(torch.int64).contiguous()
    tokens, heads, head_dim = x.shape
    if rows.shape != (tokens,):
        raise ValueError("rows must hold one table row per token")
    lib.rotary_bf16(_ptr(x), x.stride(0), tokens, heads, head_dim, rotary_dim, _ptr(cos_table),
                    _ptr(sin_table), _ptr(rows), torch.get_num_threads())
    return x


def write_kv_applies(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor) -> bool:
    """Whether `write_kv` takes these: CPU tensors of the cache's dtype, each token's
    [kv_heads, head_dim] contiguous, a contiguous cache, int64 slots."""
    return (kv_cache.device.type == "cpu" and key.dtype == value.dtype == kv_cache.dtype
            and key.shape == value.shape and key.dim() == 3 and kv_cache.is_contiguous()
            and key.shape[1:] == kv_cache.shape[3:] and slot_mapping.dtype == torch.int64
            and slot_mapping.shape == key.shape[:1]
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and available())


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`write_kv_reference` in one C call (check `write_kv_applies` first); a copy, so exact."""
    lib = _load()
    assert lib is not None
    slots = slot_mapping.contiguous()
    size = key.element_size()
    row_bytes = key.shape[1] * key.shape[2] * size
    lib.write_kv_rows(_ptr(key), key.stride(0) * size, _ptr(value), value.stride(0) * size,
                      _ptr(kv_cache), _ptr(slots), key.shape[0], kv_cache.shape[2], row_bytes,
                      torch.get_num_threads())


def silu_and_mul_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.dtype == up.dtype == torch.bfloat16 and gate.device.type == "cpu"
            and gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == 1
            and up.stride(1) == 1 and available())


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for bf16 rows with PyTorch's roundings (check `silu_and_mul_applies`)."""
    lib = _load()
    assert lib is not None
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.silu_and_mul_bf16(_ptr(gate), gate.stride(0), _ptr(up), up.stride(0), _ptr(out),
                          gate.shape[0], gate.shape[1], torch.get_num_threads())
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.add_rms_norm_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = [vp, i64, vp, i64, vp, vp, vp, i64, i64, ctypes.c_float,
                                      ctypes.c_int]
    lib.rotary_bf16.restype = None
    lib.rotary_bf16.argtypes = [vp, i64, i64, i64, i64, i64, vp, vp, vp, ctypes.c_int]
    lib.write_kv_rows.restype = None
    lib.write_kv_rows.argtypes = [vp, i64, vp, i64, vp, vp, i64, i64, i64, ctypes.c_int]
    lib.silu_and_mul_bf16.restype = None
    lib.silu_and_mul_bf16.argtypes = [vp, i64, vp, i64, vp, i64, i64, ctypes.c_int]


_LIB = LazyLibrary(_SOURCE, (_SOURCE.with_name("simd_math.h"),), "CPU fused-op kernels", _declare)


def _load() -> ctypes.CDLL | None:
    return _LIB.get()
