"""CPU causal prefill attention over the paged KV cache for bfloat16 and float32 models: a C
kernel (paged_prefill.c; AVX-512 + AVX512-BF16 for bf16, AVX-512F for float32) built once and
called through ctypes, next to its plain-PyTorch reference.

Used by the PyTorch attention backend for every multi-token request of a step (fresh prompts
and chunks after cached context) when the CPU has what the model's dtype needs and the layer
has no sliding window or soft cap; elsewhere SDPA serves. It reads K and V from
the cache (the step's new K/V are written there first), so a fresh prompt and a chunk after a
prefix-cache hit take the same path. q.k runs on `vdpbf16ps` (bf16 products are exact, summed
in float32), the softmax in float32, p.V on `vdpbf16ps` with the weights rounded to bf16 (as
PyTorch's bf16 flash attention on CPU does for its p.V GEMM) into float32 sums, and the output
is rounded to bf16 once. float32 (paged_prefill_f32.h) computes every step in float32: the same
result as the reference up to the order of float32 additions.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import LazyLibrary
from kernels.cpu.build import ptr as _ptr

_SOURCE = Path(__file__).with_name("paged_prefill.c")
MAX_GROUP = 128  # query heads per kv head the kernel's tile buffers hold
DTYPES = (torch.bfloat16, torch.float32)  # query, cache and out all of one of these


def paged_prefill_reference(
    query: torch.Tensor,  # [tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    q_start: list[int], q_len: list[int], seq_len: list[int],
    scale: float,
) -> torch.Tensor:
    """Per request k: its q_len[k] query rows (from q_start[k]) are positions
    seq_len[k] - q_len[k] .. seq_len[k] - 1 and attend causally over its cached keys, in float32.
    Rows of other requests are zero."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for k, (start, n, length) in enumerate(zip(q_start, q_len, seq_len, strict=True)):
        ids = block_table[k, : -(-length // block_size)].long()
        keys = kv_cache[ids, 0].reshape(-1, kv_heads, head_dim)[:length].float()
        values = kv_cache[ids, 1].reshape(-1, kv_heads, head_dim)[:length].float()
        group = num_heads // kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, length, d]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start: start + n].float().transpose(0, 1)  # [heads, n, d]
        scores = q @ keys.transpose(1, 2) * scale  # [heads, n, length]
        pos = torch.arange(length - n, length)
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos[:, None], float("-inf"))
        out[start: start + n] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def available() -> bool:
    return _load() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel takes these sizes on this CPU: bf16 needs AVX512-BF16, head_dim a
    multiple of 32 up to 256 and block_size a multiple of 16; float32 needs AVX-512F and
    head_dim a multiple of 16 up to 256."""
    lib = _load()
    return (lib is not None and dtype in DTYPES and num_heads // num_kv_heads <= MAX_GROUP
            and bool(lib.paged_prefill_supported(head_dim, block_size, int(dtype == torch.float32))))


def paged_prefill(
    query: torch.Tensor,  # [tokens, num_heads, head_dim] bf16 or f32, heads contiguous
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], query's dtype
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    q_start: list[int], q_len: list[int], seq_len: list[int],
    scale: float,
    out: torch.Tensor,  # [tokens, num_heads, head_dim], query's dtype; the requests' rows are written
) -> None:
    """The compiled kernel; the rows it writes equal `paged_prefill_reference`'s (rounded to
    bf16 for a bf16 model, whose p.V weights are bf16 too; up to float32 summation order).
    Checks inputs first."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU paged-prefill kernel is not available")
    tokens, num_heads, head_dim = query.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    dtype = query.dtype
    for name, t in (("query", query), ("kv_cache", kv_cache), ("out", out)):
        if t.dtype not in DTYPES or t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be bfloat16 or float32 (all three alike) on the CPU, "
                             f"got {t.dtype} on {t.device}")
    if query.stride(2) != 1 or query.stride(1) != head_dim or out.stride(2) != 1 \
            or out.stride(1) != head_dim or out.shape != query.shape:
        raise ValueError("query and out must be [tokens, heads, head_dim] with contiguous heads")
    if not kv_cache.is_contiguous() or kv_cache.shape[4] != head_dim or num_heads % kv_heads:
        raise ValueError("kv_cache must be contiguous, with query's head_dim and a divisor of its heads")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise ValueError("block_table must be contiguous int32")
    if not (len(q_start) == len(q_len) == len(seq_len) == block_table.shape[0]):
        raise ValueError("q_start, q_len and seq_len need one entry per block-table row")
    for start, n, length in zip(q_start, q_len, seq_len, strict=True):
        if not (1 <= n <= length <= block_table.shape[1] * block_size and start >= 0
                and start + n <= tokens):
            raise ValueError(f"bad request: q_start {start}, q_len {n}, seq_len {length}")
    if not supports(num_heads, kv_heads, head_dim, block_size, dtype):
        raise ValueError(f"sizes the kernel does not take on this CPU: head_dim {head_dim}, "
                         f"block_size {block_size}, {num_heads}/{kv_heads} heads")
    starts = torch.tensor(q_start, dtype=torch.int64)
    lens = torch.tensor(q_len, dtype=torch.int64)
    seqs = torch.tensor(seq_len, dtype=torch.int64)
    failed = lib.paged_prefill(
        _ptr(query), query.stride(0), _ptr(kv_cache), _ptr(block_table), block_table.shape[1],
        _ptr(starts), _ptr(lens), _ptr(seqs), len(q_len), _ptr(out), out.stride(0), num_heads,
        kv_heads, head_dim, block_size, ctypes.c_float(scale), torch.get_num_threads(),
        int(dtype == torch.float32))
    if failed:
        raise ValueError("paged_prefill: sizes over the kernel's limits")


def _declare(lib: ctypes.CDLL) -> None:
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.paged_prefill_supported.restype = ctypes.c_int
    lib.paged_prefill_supported.argtypes = [i64, i64, ctypes.c_int]
    lib.paged_prefill.restype = ctypes.c_int
    lib.paged_prefill.argtypes = [vp, i64, vp, vp, i64, vp, vp, vp, i64, vp, i64, i64, i64, i64,
                                  i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]


_LIB = LazyLibrary(_SOURCE, (_SOURCE.with_name("simd_math.h"), _SOURCE.with_name("paged_prefill_f32.h")),
                   "CPU paged-prefill kernel", _declare)


def _load() -> ctypes.CDLL | None:
    return _LIB.get()
