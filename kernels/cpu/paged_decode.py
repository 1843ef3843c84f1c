"""CPU paged decode attention: a small C kernel (paged_decode.c) built once with the system C
compiler and called through ctypes, next to its plain-PyTorch reference.

Used by the PyTorch attention backend for decode tokens on the CPU. The KV cache may be float32
or bfloat16 (read and widened to float32 in the kernel: a bf16 cache halves the bytes a decode
step reads); the query and the output are float32 or bfloat16 (a bf16 query is widened in the
kernel and its output rounded back to bf16, nearest-even: the values of a float32 call between
`.float()` and `.to(torch.bfloat16)`, without those two tensors); all arithmetic is float32,
except that with a bf16 cache on a CPU with AVX512-BF16 q.k runs on `vdpbf16ps` with the query
rounded to bf16 (a bf16 model's query is bf16 already, so nothing is lost there; products are
exact and summed in float32). On AVX-512 CPUs head_dim 16, 32, 64, 128 and 256 take a vectorized body
(paged_decode_avx512.h, 1.4-1.9x the portable loop on the default model's shapes, 64 requests);
`generic=True` forces the portable loop, which the tests compare. Where no C compiler
is present the backend keeps its pure-PyTorch path: `available()` says which.

Options (both off by default; 0 or None = off): `sliding_window` attends to the last
`sliding_window` tokens only (positions `seq_len - window .. seq_len - 1`; blocks before them are
never read), `logits_soft_cap` turns scores into `cap * tanh(q.k * scale / cap)` (Gemma 2).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import LazyLibrary
from kernels.cpu.build import ptr as _ptr

_SOURCE = Path(__file__).with_name("paged_decode.c")
# included by the source: the generic loop and the AVX-512 one
_HEADERS = (Path(__file__).with_name("paged_decode_attend.h"),
            Path(__file__).with_name("paged_decode_avx512.h"))
# Sizes the kernel's fixed per-item buffers hold (paged_decode.c MAX_*).
MAX_HEADS, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 128, 256, 64
KV_DTYPES = (torch.float32, torch.bfloat16)  # cache element types the kernel reads
# Query (and output) types: a bf16 query is widened to float32 inside the kernel and the output
# rounded back to bf16 (nearest-even), the values `paged_decode(q.float(), ...).to(bf16)` gives.
QUERY_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_reference(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V over each request's first seq_len cached tokens (GQA-aware), or
    its last `sliding_window` of them; scores soft-capped when `logits_soft_cap` is set. Reads
    only the blocks holding attended tokens. A bf16 cache is widened to the query's dtype."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b in range(num_reqs):
        length = int(seq_lens[b])
        first = max(0, length - sliding_window) if sliding_window else 0
        ids = block_table[b, first // block_size: -(-length // block_size)].long()
        skip = first % block_size
        k = kv_cache[ids, 0].reshape(-1, num_kv_heads, head_dim)[skip: skip + length - first]
        v = kv_cache[ids, 1].reshape(-1, num_kv_heads, head_dim)[skip: skip + length - first]
        k = k.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, len, d]
        v = v.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (k @ query[b].unsqueeze(-1)).squeeze(-1) * scale  # [num_heads, len]
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        out[b] = (scores.softmax(-1).unsqueeze(1) @ v).squeeze(1)
    return out


def available() -> bool:
    """Whether the compiled kernel can be used in this process."""
    return _load() is not None


def vectorized(head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether `paged_decode` takes the AVX-512 body for this head_dim and cache dtype."""
    lib = _load()
    return lib is not None and bool(lib.paged_decode_vectorized(head_dim, int(kv_dtype == torch.bfloat16)))


def supports(num_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether these sizes fit the kernel's buffers (otherwise use the PyTorch path)."""
    return num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE


def paged_decode(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim] float32 or bf16 (out: the same), cpu
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] f32 or bf16, cpu
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, cpu
    seq_lens: torch.Tensor,  # [num_reqs] int32, cpu
    scale: float,
    sliding_window: int | None = None,  # None or 0 = no window
    logits_soft_cap: float | None = None,  # None or 0 = no cap
    generic: bool = False,  # True: the portable loop even where the AVX-512 one applies (tests)
) -> torch.Tensor:
    """The compiled kernel; same result as `paged_decode_reference`. Checks inputs first.

    On CPUs with AVX-512 and head_dim 16, 32, 64, 128 or 256 it runs the vectorized body
    (`vectorized()` says whether it would); elsewhere the portable loop."""
    check_inputs(query, kv_cache, block_table, seq_lens, sliding_window, logits_soft_cap)
    return paged_decode_checked(query, kv_cache, block_table, seq_lens, scale, sliding_window,
                                logits_soft_cap, generic)


def paged_decode_checked(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, generic: bool = False,
) -> torch.Tensor:
    """`paged_decode` without the checks: for a caller that ran `check_inputs` on tensors of
    the same shapes, dtypes and layout (the attention backend checks a step's block table and
    lengths once, at its first layer, instead of once per layer)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU paged-decode kernel could not be built (no C compiler?)")
    num_reqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    failed = lib.paged_decode(
        _ptr(query), query.stride(0), _ptr(kv_cache), _ptr(block_table), _ptr(seq_lens),
        _ptr(out), out.stride(0), num_reqs, num_heads, kv_cache.shape[3], head_dim,
        kv_cache.shape[2], block_table.shape[1], ctypes.c_float(scale), int(sliding_window or 0),
        ctypes.c_float(logits_soft_cap or 0.0), torch.get_num_threads(),
        int(kv_cache.dtype == torch.bfloat16), int(generic), int(query.dtype == torch.bfloat16))
    if failed:
        raise ValueError(f"paged_decode: sizes over the kernel's limits (heads <= {MAX_HEADS}, "
                         f"head_dim <= {MAX_HEAD_DIM}, block_size <= {MAX_BLOCK_SIZE})")
    return out


def check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
    """Raises ValueError naming what `paged_decode` cannot take."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 0):
        raise ValueError(f"sliding_window must be an int >= 0 (0 = none), got {sliding_window!r}")
    if logits_soft_cap is not None and not 0.0 <= logits_soft_cap < float("inf"):
        raise ValueError(f"logits_soft_cap must be finite and >= 0 (0 = none), got {logits_soft_cap!r}")
    for name, t in (("query", query), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if query.dtype not in QUERY_DTYPES or kv_cache.dtype not in KV_DTYPES:
        raise ValueError(f"query and kv_cache must be float32 or bfloat16, got "
                         f"{query.dtype} / {kv_cache.dtype}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"query must be [reqs, heads, dim] and kv_cache [blocks, 2, block, kv_heads, "
                         f"dim], got {tuple(query.shape)} / {tuple(kv_cache.shape)}")
    num_reqs, num_heads, head_dim = query.shape
    if kv_cache.shape[4] != head_dim or num_heads % kv_cache.shape[3] != 0:
        raise ValueError("head_dim must match and num_heads must be a multiple of num_kv_heads")
    if tuple(block_table.shape[:1]) != (num_reqs,) or tuple(seq_lens.shape) != (num_reqs,):
        raise ValueError("block_table and seq_lens must have one row per request")
    if not kv_cache.is_contiguous() or not block_table.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError("kv_cache, block_table and seq_lens must be contiguous")
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("query must be contiguous within each token ([heads, dim] rows)")
    if num_reqs and int(seq_lens.max()) > block_table.shape[1] * kv_cache.shape[2]:
        raise ValueError("a seq_len is longer than its block table covers")
    if not supports(num_heads, head_dim, kv_cache.shape[2]):
        raise ValueError(f"sizes over the kernel's limits: num_heads {num_heads} (<= {MAX_HEADS}), "
                         f"head_dim {head_dim} (<= {MAX_HEAD_DIM}), block_size {kv_cache.shape[2]} "
                         f"(<= {MAX_BLOCK_SIZE})")


def _declare(lib: ctypes.CDLL) -> None:
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
        ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.paged_decode_vectorized.restype = ctypes.c_int
    lib.paged_decode_vectorized.argtypes = [ctypes.c_int64, ctypes.c_int]


_LIB = LazyLibrary(_SOURCE, _HEADERS, "CPU paged-decode kernel", _declare)


def _load() -> ctypes.CDLL | None:
    return _LIB.get()
