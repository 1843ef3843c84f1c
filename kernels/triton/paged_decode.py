"""Paged decode attention: one query token per request attends to its first seq_lens[i] cached
tokens (this step's K/V already written), GQA-aware.

The plain-PyTorch reference comes first. The Triton version is flash-decoding:
  1. `_partition_kernel`, grid (num_reqs, num_kv_heads, num_splits): each program takes ONE kv head
     and the GROUP query heads sharing it (each K/V element is read once), walks one fixed-size
     partition of the context in tiles of BLOCK_N tokens gathered through the block table, and
     keeps an online softmax (running max / sum in the log2 domain, fp32 accumulator).
  2. `_combine_kernel`, grid (num_reqs, num_heads): merges the partitions' (max, sum, acc) with
     log-sum-exp weights into `out`.
With a single partition, step 1 writes `out` directly and step 2 is skipped. The grid depends only
on host ints (max_seq_len), never on tensor contents, so the launch is CUDA-graph capturable.

Options, each a `tl.constexpr` switch (off: the kernels compile to the code without them):
- sliding window (WINDOW): a request attends to its last `window` tokens only, positions
  `max(0, seq_len - window) .. seq_len - 1`. The partitions tile that range instead of
  `0 .. seq_len - 1` (so the grid has cdiv(min(max_seq_len, window), partition_size) splits) and
  no block before it is read: the cache manager may have freed it (null block in the table).
- logit soft cap (SOFTCAP): scores become `cap * tanh(q.k * scale / cap)` (Gemma 2); `tl` has no
  tanh, so tanh(x) = 2 * sigmoid(2x) - 1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton._checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_rows_contiguous,
    check_shape,
    interpreter_enabled,
    require_cuda_or_interpreter,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_PARTITION_SIZE = 512  # context tokens per program of step 1
DEFAULT_TILE_TOKENS = 64  # tokens per inner-loop tile (several cache blocks gathered at once)
_COMBINE_CHUNK = 16  # partitions merged per step of the combine loop
_LOG2E = 1.4426950408889634


def paged_decode_attention_reference(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V over each request's first seq_len cached tokens (or its last
    `sliding_window` of them, reading only their blocks), scores soft-capped when
    `logits_soft_cap` is set, in float32, cast back to query's dtype; a request with seq_len 0
    gets zeros."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for b in range(num_reqs):
        length = int(seq_lens[b])
        if length == 0:
            continue
        first = max(0, length - sliding_window) if sliding_window else 0
        ids = block_table[b, first // block_size: -(-length // block_size)].long()
        keys = slice(first % block_size, first % block_size + length - first)
        k = kv_cache[ids, 0].reshape(-1, num_kv_heads, head_dim)[keys].float()  # [len, kvh, d]
        v = kv_cache[ids, 1].reshape(-1, num_kv_heads, head_dim)[keys].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, len, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (k @ query[b].float().unsqueeze(-1)).squeeze(-1) * scale  # [num_heads, len]
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        out[b] = (scores.softmax(-1).unsqueeze(1) @ v).squeeze(1).to(query.dtype)
    return out


@triton.jit
def _partition_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale,  # scale * log2(e); with SOFTCAP scale / cap
    q_stride_req, out_stride_req, block_table_stride,
    cache_block_stride, cache_kv_stride, cache_slot_stride,
    num_splits,
    window,  # sliding window (tokens), read only with WINDOW
    cap_scale,  # cap * log2(e), read only with SOFTCAP
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
    SINGLE: tl.constexpr,  # one partition: normalize and write out directly
    UPCAST: tl.constexpr,  # dot in exact fp32 (see _dot_in_fp32)
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + req)
    if WINDOW:  # partitions tile the window, from its first token
        start = tl.maximum(seq_len - window, 0) + split * PARTITION
    else:
        start = split * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g  # the query heads sharing this kv head
    d_ok = d < HEAD_DIM  # all true unless head_dim is padded
    q_mask = (g[:, None] < GROUP) & d_ok[None, :]
    q = tl.load(q_ptr + req.to(tl.int64) * q_stride_req + heads[:, None] * HEAD_DIM + d[None, :],
                mask=q_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, TILE)
    head_base = cache_ptr + kv_head * HEAD_DIM  # cache rows are [num_kv_heads, head_dim]
    for tile_start in range(start, end, TILE):
        tok = tile_start + n  # [TILE] positions in the request
        tok_ok = tok < end
        blk = tl.load(block_table_ptr + req.to(tl.int64) * block_table_stride + tok // BLOCK_SIZE,
                      mask=tok_ok, other=0)
        row = blk.to(tl.int64) * cache_block_stride + (tok % BLOCK_SIZE) * cache_slot_stride
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(head_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE, D]
        v = tl.load(head_base + cache_kv_stride + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [GROUP_PAD, TILE] fp32
        if SOFTCAP:
            s = tl.where(tok_ok[None, :], tanh(s * qk_scale) * cap_scale, float("-inf"))
        else:
            s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SINGLE:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: zeros
        tl.store(out_ptr + req.to(tl.int64) * out_stride_req + heads[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [num_reqs, num_heads, num_splits(, HEAD_DIM_PAD)]; an empty partition stores
        # -inf / 0 and the combine step skips it anyway (it only reads splits below seq_len).
        idx = (req * num_kv_heads * GROUP + heads).to(tl.int64) * num_splits + split
        g_ok = g < GROUP
        tl.store(part_m_ptr + idx, m_i, mask=g_ok)
        tl.store(part_l_ptr + idx, l_i, mask=g_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def tanh(x):
    """tanh(x) = 2 * sigmoid(2x) - 1 (`tl` has no tanh); absolute error ~1e-7 in fp32."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _combine_kernel(
    out_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    out_stride_req, num_splits,
    window,  # read only with WINDOW
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION: tl.constexpr, CHUNK: tl.constexpr, WINDOW: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + req)
    if WINDOW:  # the partitions tile the last min(seq_len, window) tokens
        used = tl.minimum(tl.cdiv(tl.minimum(seq_len, window), PARTITION), num_splits)
    else:
        used = tl.minimum(tl.cdiv(seq_len, PARTITION), num_splits)  # partitions holding tokens
    base = (req * num_heads + head).to(tl.int64) * num_splits
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_DIM_PAD)

    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for s0 in range(0, used, CHUNK):
        split = s0 + c
        ok = split < used
        m = tl.load(part_m_ptr + base + split, mask=ok, other=float("-inf"))  # [CHUNK]
        l_part = tl.load(part_l_ptr + base + split, mask=ok, other=0.0)
        a = tl.load(part_acc_ptr + (base + split)[:, None] * HEAD_DIM_PAD + d[None, :],
                    mask=ok[:, None], other=0.0)  # [CHUNK, HEAD_DIM_PAD]
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite: each chunk has a used split
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)  # [CHUNK]
        l_run = l_run * alpha + tl.sum(w * l_part, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)  # seq_len 0: zeros
    tl.store(out_ptr + req.to(tl.int64) * out_stride_req + head * HEAD_DIM + d,
             o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim], rows contiguous, any request stride
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim], rows contiguous
    *,
    sliding_window: int | None = None,  # None or 0: no window
    logits_soft_cap: float | None = None,  # None or 0: no cap
    partition_size: int = DEFAULT_PARTITION_SIZE,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Same result as `paged_decode_attention_reference`; returns `out` (allocated if None).

    `max_seq_len` is a host upper bound on seq_lens (under CUDA graphs pass max_model_len): it fixes
    the grid, cdiv(max_seq_len, partition_size) partitions per (request, kv head). Tokens past it
    are not attended to. seq_lens are not read on the host (no sync), except on CPU tensors
    (interpreter), where seq_lens > max_seq_len raise ValueError. Tuning: partition_size and
    tile_tokens (K/V rows per inner step, min(tile_tokens, partition_size)) are powers of two >= 16.
    `sliding_window` / `logits_soft_cap`: see the module docstring."""
    _check_inputs(query, kv_cache, block_table, seq_lens, out)
    window, cap = check_window_and_cap(sliding_window, logits_soft_cap)
    _check_sizes(block_table, seq_lens, kv_cache.shape[2], max_seq_len, partition_size, tile_tokens)
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16
    span = max_seq_len if window is None else min(max_seq_len, window)  # tokens one request attends
    num_splits = max(1, triton.cdiv(span, partition_size))
    single = num_splits == 1
    if single:  # unused placeholders
        part_m = part_l = part_acc = torch.empty(1, device=query.device, dtype=torch.float32)
    else:
        part_m = torch.empty(num_reqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_reqs, num_heads, num_splits, head_dim_pad, device=query.device,
                               dtype=torch.float32)
    _partition_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, kv_cache, block_table, seq_lens,
        out, part_m, part_l, part_acc,
        scale * _LOG2E if cap is None else scale / cap,
        query.stride(0), out.stride(0), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        num_splits, window or 0, (cap or 0.0) * _LOG2E,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE=min(tile_tokens, partition_size), PARTITION=partition_size,
        SINGLE=single, UPCAST=_dot_in_fp32(query.dtype),
        WINDOW=window is not None, SOFTCAP=cap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        _combine_kernel[(num_reqs, num_heads)](
            out, seq_lens, part_m, part_l, part_acc,
            out.stride(0), num_splits, window or 0,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            PARTITION=partition_size, CHUNK=_COMBINE_CHUNK, WINDOW=window is not None,
            num_warps=num_warps,
        )
    return out


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """float32 inputs take an exact (ieee, not TF32) fp32 dot. So does bfloat16 under the
    interpreter: triton 3.9's interpreted tl.dot multiplies bfloat16 bit patterns as integers."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreter_enabled())


def decode_bytes(total_context_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes a decode step reads for `total_context_tokens` (sum of seq_lens): the
    kernel's compulsory memory traffic, for bandwidth numbers in benchmarks."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * total_context_tokens * num_kv_heads * head_dim * itemsize


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor | None) -> None:
    require_cuda_or_interpreter(query, "query")
    named = [("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)]
    if out is not None:
        named.append(("out", out))
    for name, t in named:
        check_device(name, t, query.device)
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("kv_cache", kv_cache, query.dtype)
    check_dtype("block_table", block_table, torch.int32)
    check_dtype("seq_lens", seq_lens, torch.int32)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_reqs, num_heads, head_dim], got {list(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                         f"got {list(kv_cache.shape)}")
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    check_shape("kv_cache", kv_cache, (None, 2, None, None, head_dim))
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query's num_heads {num_heads} must be a multiple of kv_cache's "
                         f"num_kv_heads {num_kv_heads}")
    check_shape("block_table", block_table, (num_reqs, None))
    check_shape("seq_lens", seq_lens, (num_reqs,))
    check_rows_contiguous("query", query)
    check_contiguous("kv_cache", kv_cache)
    check_rows_contiguous("block_table", block_table)
    check_contiguous("seq_lens", seq_lens)
    if out is not None:
        check_dtype("out", out, query.dtype)
        check_shape("out", out, tuple(query.shape))
        check_rows_contiguous("out", out)


def check_window_and_cap(sliding_window: int | None,
                   logits_soft_cap: float | None) -> tuple[int | None, float | None]:
    """The kernels' sliding_window / logits_soft_cap arguments as (window, cap), None where off
    (None or 0); ValueError for a negative or non-int window or a negative or non-finite cap."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 0):
        raise ValueError(f"sliding_window must be an int >= 0 (0 = none), got {sliding_window!r}")
    if logits_soft_cap is not None and not 0.0 <= logits_soft_cap < math.inf:
        raise ValueError(f"logits_soft_cap must be finite and >= 0 (0 = none), got {logits_soft_cap!r}")
    return sliding_window or None, (float(logits_soft_cap) if logits_soft_cap else None)


def _check_sizes(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_seq_len: int,
                 partition_size: int, tile_tokens: int) -> None:
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} is more than block_table covers "
                         f"({block_table.shape[1]} blocks of {block_size})")
    for name, size in (("partition_size", partition_size), ("tile_tokens", tile_tokens)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if seq_lens.device.type == "cpu" and seq_lens.numel() and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"seq_lens has a value over max_seq_len {max_seq_len}")
