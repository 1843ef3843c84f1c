"""Triton prefill/extend attention over the paged KV cache, next to its plain-PyTorch reference.

One call serves a varlen batch of new tokens: fresh prefills, chunked prefills, prefix-cache hits
and decode rows (q_len 1) mixed together. Request i owns query rows
`query_start_loc[i]:query_start_loc[i+1]` (q_len_i, possibly 0) and has `seq_lens[i]` tokens of
context after this step, so its new tokens sit at positions `seq_lens[i] - q_len_i .. seq_lens[i] - 1`.
Their K/V are already in the cache (the backend writes first): every key and value is read from
`kv_cache` through `block_table`. A new token attends to all cached context and causally to the
new tokens (keys at positions <= its own): the bottom-right aligned causal mask.

Kernel layout (flash-attention style, online softmax in fp32, exp2 with log2(e) folded into the
scale). One program handles one tile of a request's new tokens for one kv head, and folds the
GROUP query heads of that kv head into the M dimension: tile row r is token `r // GROUP`, query
head `kv_head * GROUP + r % GROUP`. Why fold rather than one program per query head:
- every K/V tile is loaded once for all GROUP heads (GROUP x less K/V traffic from L2/HBM);
- the GROUP heads of a token are adjacent in `query` ([tokens, heads, dim]), so the Q tile is
  still one contiguous run of rows per token;
- decode rows (q_len 1) fill GROUP rows of the tile instead of one, and the causal diagonal of a
  tile spans BLOCK_M / GROUP key positions, so fewer key tiles need masking.
Key tiles wholly below the causal limit of the tile's first row run without masks; the remaining
tiles up to the limit of its last row run masked; tiles past that are never visited.

Options, each a `tl.constexpr` switch (off: the kernel compiles to the code without them):
- sliding window (WINDOW): a query at position q sees keys q - window < k <= q. Key tiles wholly
  before the window of the tile's first row are never visited (nor their blocks read: the cache
  manager may have freed them, null block in the table); tiles from the first row's window start
  up to where every row's window has begun run masked (keys before that start are not even
  loaded), then unmasked tiles, then the causal tail as above. A row may see no key of a masked
  tile yet: its running max stays -inf and the update subtracts 0 instead (no NaN).
- logit soft cap (SOFTCAP): scores become `cap * tanh(q.k * scale / cap)` (Gemma 2), with
  tanh(x) = 2 * sigmoid(2x) - 1 (`tl` has no tanh).
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
from kernels.triton.paged_decode import check_window_and_cap, tanh
from kernels.triton.tl_math import dot

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


def paged_prefill_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per request in float32, with the bottom-right causal mask, and
    the sliding window (q - window < k <= q) and soft cap (cap * tanh(scores / cap)) when set;
    reads only the blocks from the first new token's window start on.
    Rows past `query_start_loc[-1]` are zero. Returns [num_tokens, num_heads, head_dim]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    starts = [int(s) for s in query_start_loc.tolist()]
    for i, seq_len in enumerate(int(n) for n in seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        first = max(0, seq_len - (hi - lo) - sliding_window + 1) if sliding_window else 0
        ids = block_table[i, first // block_size: -(-seq_len // block_size)].long()
        keys = slice(first % block_size, first % block_size + seq_len - first)
        k = kv_cache[ids, 0].reshape(-1, num_kv_heads, head_dim)[keys].float()  # [seq - first, kvh, d]
        v = kv_cache[ids, 1].reshape(-1, num_kv_heads, head_dim)[keys].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq - first, h, d]
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), k) * scale
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        k_pos = torch.arange(first, seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos[:, None]  # [q, seq - first]
        if sliding_window:
            allowed &= k_pos > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows of [heads, dim] contiguous
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, column stride 1
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], rows contiguous
    *,
    sliding_window: int | None = None,  # None or 0: no window
    logits_soft_cap: float | None = None,  # None or 0: no cap
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Same result as `paged_prefill_attention_reference`, written into `out` (allocated when
    None) and returned. `max_query_len` is a host upper bound of every q_len: it sizes the grid,
    so the launch reads no tensor contents (CUDA-graph capturable). Query rows of a request past
    `max_query_len`, and rows past `query_start_loc[-1]`, are left unwritten. Every seq_len must
    be covered by its block-table row (not checked: that would need a host sync).
    Tuning: block_m query rows per program (tokens x GROUP heads, widened to hold GROUP),
    block_n keys per tile; defaults from `_default_tiles`. `sliding_window` / `logits_soft_cap`:
    see the module docstring."""
    _check_inputs(query, kv_cache, block_table, query_start_loc, seq_lens, scale, max_query_len, out)
    window, cap = check_window_and_cap(sliding_window, logits_soft_cap)
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    wide = query.dtype == torch.float32
    default_m, default_n, default_warps = _default_tiles(wide, head_dim)
    block_m = block_m if block_m is not None else default_m
    block_n = block_n if block_n is not None else default_n
    num_warps = num_warps if num_warps is not None else default_warps
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    block_m = max(block_m, triton.next_power_of_2(group))  # a tile holds at least one token
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if max_query_len == 0 or num_reqs == 0 or num_tokens == 0:
        return out
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(max_query_len, tokens_per_tile), num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        query, kv_cache, out, block_table, query_start_loc, seq_lens,
        float(scale) * _LOG2E if cap is None else float(scale) / cap,
        query.stride(0), out.stride(0), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        window or 0, (cap or 0.0) * _LOG2E,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=wide, UPCAST=query.dtype == torch.bfloat16 and interpreter_enabled(),
        WINDOW=window is not None, SOFTCAP=cap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _default_tiles(wide: bool, head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) that compile for sm_90 without register spills (ptxas -v).
    float32 (IEEE dot on CUDA cores) is for exactness checks, not speed."""
    if wide:
        return (64, 32, 8) if head_dim <= 64 else (32, 16, 8)
    if head_dim <= 64:  # H200 sweep (benchmarks/tune_attention_gpu.py): 64x64 beat 128x64 by 15%
        return 64, 64, 4
    return (128, 64, 8) if head_dim <= 128 else (64, 32, 8)


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, out_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e); with SOFTCAP scale / cap
    stride_q_tok, stride_out_tok, stride_bt_req,
    stride_kv_block, stride_kv_kind, stride_kv_tok,
    window,  # sliding window (keys), read only with WINDOW
    cap_scale,  # cap * log2(e), read only with SOFTCAP
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # new tokens per tile
    # The last tiles (most keys under the causal mask) start first: better tail balance.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    m_start = tile * TOKENS
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # keys before the first new token

    rows = tl.arange(0, BLOCK_M)
    tok = m_start + rows // GROUP  # new-token index within the request, per row
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + tok).to(tl.int64) * stride_q_tok + head * HEAD_DIM  # [BLOCK_M]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = context + tok  # absolute position per row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_base = kv_ptr + kv_head * HEAD_DIM
    # Every row sees keys < context + m_start + 1; the last row sees keys < key_end.
    unmasked_end = (context + m_start + 1) // BLOCK_N * BLOCK_N
    key_end = context + tl.minimum(m_start + TOKENS, q_len)
    if WINDOW:
        # The first row sees keys from `lo` on, the last row (at key_end - 1) from key_end - window
        # on: keys from full_lo on are past every row's window start.
        lo = tl.maximum(context + m_start - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(key_end - window, 0), BLOCK_N) * BLOCK_N
        for start_n in range(lo // BLOCK_N * BLOCK_N, tl.minimum(full_lo, key_end), BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
                stride_kv_block, stride_kv_kind, stride_kv_tok, lo, window, cap_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, UPCAST, True, True, SOFTCAP)
        for start_n in range(full_lo, unmasked_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
                stride_kv_block, stride_kv_kind, stride_kv_tok, lo, window, cap_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, UPCAST, False, True, SOFTCAP)
        for start_n in range(tl.maximum(full_lo, unmasked_end), key_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
                stride_kv_block, stride_kv_kind, stride_kv_tok, lo, window, cap_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, UPCAST, True, True, SOFTCAP)
    else:
        for start_n in range(0, unmasked_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
                stride_kv_block, stride_kv_kind, stride_kv_tok, 0, 0, cap_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, UPCAST, False, False, SOFTCAP)
        for start_n in range(unmasked_end, key_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
                stride_kv_block, stride_kv_kind, stride_kv_tok, 0, 0, cap_scale,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE, UPCAST, True, False, SOFTCAP)

    if WINDOW:  # padding rows (past q_len) may see no key under a window: no 0 / 0 there
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    else:
        acc = acc / l_i[:, None]  # key 0 is visible to every row, so l_i > 0
    o_off = (q_start + tok).to(tl.int64) * stride_out_tok + head * HEAD_DIM
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, start_n, seq_len, kv_base, bt_row, qk_scale,
    stride_kv_block, stride_kv_kind, stride_kv_tok,
    lo, window, cap_scale,  # lo: first key any row's window sees; used only with WINDOW and MASK
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One BLOCK_N tile of keys, gathered through the block table, folded into the online softmax."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # key positions
    offs_d = tl.arange(0, HEAD_DIM)
    if MASK:
        if WINDOW:  # keys before `lo` (perhaps in freed blocks) are not loaded
            key_ok = (offs_n < seq_len) & (offs_n >= lo)
        else:
            key_ok = offs_n < seq_len
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(bt_row + offs_n // BLOCK_SIZE)
    slot = block.to(tl.int64) * stride_kv_block + (offs_n % BLOCK_SIZE) * stride_kv_tok  # [BLOCK_N]
    if MASK:
        k = tl.load(kv_base + slot[None, :] + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(kv_base + stride_kv_kind + slot[:, None] + offs_d[None, :],
                    mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(kv_base + slot[None, :] + offs_d[:, None])  # [HEAD_DIM, BLOCK_N]
        v = tl.load(kv_base + stride_kv_kind + slot[:, None] + offs_d[None, :])  # [BLOCK_N, HEAD_DIM]
    if SOFTCAP:
        qk = dot(q, k, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), IEEE, UPCAST)
        qk = tanh(qk * qk_scale) * cap_scale  # cap * tanh(scores / cap) * log2(e)
    else:
        qk = dot(q, k, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), IEEE, UPCAST) * qk_scale
    if MASK:
        if WINDOW:
            seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(seen, qk, float("-inf"))
        else:
            qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASK and WINDOW:  # a row whose window starts past this tile has m_new -inf so far
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = dot(p.to(v.dtype), v, acc, IEEE, UPCAST)
    return acc, l_i, m_new




def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int, out: torch.Tensor | None) -> None:
    """Shapes, dtypes, strides and devices only: reads no tensor contents (no host sync)."""
    require_cuda_or_interpreter(query, "query")
    named = [("kv_cache", kv_cache), ("block_table", block_table), ("query_start_loc", query_start_loc),
             ("seq_lens", seq_lens)] + ([("out", out)] if out is not None else [])
    for name, t in named:
        check_device(name, t, query.device)
    check_dtype("query", query, _DTYPES)
    check_shape("query", query, (None, None, None))
    num_tokens, num_heads, head_dim = query.shape
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"query head_dim must be a power of two in 16..256, got {head_dim}")
    check_rows_contiguous("query", query)
    check_dtype("kv_cache", kv_cache, query.dtype)
    check_shape("kv_cache", kv_cache, (None, 2, None, None, head_dim))
    num_kv_heads = kv_cache.shape[3]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query num_heads ({num_heads}) must be a multiple of kv_cache num_kv_heads "
                         f"({num_kv_heads})")
    check_contiguous("kv_cache", kv_cache)
    check_dtype("seq_lens", seq_lens, torch.int32)
    check_shape("seq_lens", seq_lens, (None,))
    check_contiguous("seq_lens", seq_lens)
    num_reqs = seq_lens.shape[0]
    check_dtype("query_start_loc", query_start_loc, torch.int32)
    check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
    check_contiguous("query_start_loc", query_start_loc)
    check_dtype("block_table", block_table, torch.int32)
    check_shape("block_table", block_table, (num_reqs, None))
    if block_table.shape[1] and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a host int >= 0, got {max_query_len!r}")
    if out is not None:
        check_dtype("out", out, query.dtype)
        check_shape("out", out, (num_tokens, num_heads, head_dim))
        check_rows_contiguous("out", out)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
