"""PyTorch (CPU) attention backend over the paged KV cache, and its plain reference.

Fast path, per step and layer:
- the new K/V of the whole batch is written with one indexed assignment;
- a request without cached context (a fresh prefill) attends over its own new K/V directly
  with `scaled_dot_product_attention(is_causal=True)`;
- every other request (chunked prefill, prefix-cache hit, decode) gathers its own blocks from
  the cache (`index_select`, small enough to stay in CPU cache) and attends over them: decode
  tokens with two plain matmuls, multi-token chunks with SDPA under a bottom-right causal mask.
  (Measured on 2 cores, 64 decode requests of 64..700 tokens: one padded batched gather + one
  SDPA call is 3-4x slower than this per-request loop, as the padded gather goes through RAM.)

On a CPU with AVX-512 (layers without window or cap) two C kernels serve instead: decode
tokens through kernels/cpu/paged_decode.c (bf16 or float32 cache), every multi-token request
(fresh prompt or chunk) through kernels/cpu/paged_prefill.c (bf16 with AVX512-BF16, float32
with AVX-512F), both reading K/V from the cache, one call per layer each. The paths below serve
other CPUs, windowed or capped layers and other devices.

Every SDPA call gets 4-D `[1, heads, len, d]` inputs: on CPU, 3-D inputs take the unfused math
path, measured 4x slower (L=512, 9 heads, d=64, 2 threads).
GQA is handled without repeating K/V: the `group = num_heads // num_kv_heads` query heads that
share a KV head are folded into the query-length dimension of SDPA.

Sliding window and soft cap (see `engine.attention.backend`). A window at least as long as a
request's context is dropped for that request, and requests without window and cap take exactly
the paths above. Otherwise:
- decode tokens: the C kernel takes both options; the matmul path gathers only the last
  `window` tokens (no mask needed) and caps its scores;
- multi-token requests gather the blocks from position `seq_len - q_len - window + 1` on (the
  first query's window start), never the blocks before it, and attend in chunks of
  `_QUERY_CHUNK` new tokens, each over the keys its window reaches, so that a long prompt under
  a small window costs O(q_len * window), not O(q_len^2): SDPA under a windowed bottom-right
  mask, or with a soft cap (which SDPA cannot apply) explicit matmuls, tanh and softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, check_attention_options
from kernels.cpu import fused_ops
from kernels.cpu import paged_decode as paged_decode_kernel
from kernels.cpu import paged_prefill as paged_prefill_kernel

_QUERY_CHUNK = 256  # new tokens per attention call on the windowed / capped multi-token path


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch; meant for CPU (works on any device)."""

    name = "torch"

    def __init__(self) -> None:
        # What the decode kernel's input checks last passed for: the step's metadata (held, so
        # its id is not reused), its block table made contiguous, and the query / cache layout.
        # Every layer of a step shares the metadata, so a step checks once, not once per layer.
        self._decode_checked: tuple[object, ...] | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        window, cap = check_attention_options(sliding_window, logits_soft_cap)
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        pure = self._pure_decode(query, kv_cache, metadata, scale, window, cap)
        if pure is not None:
            return pure
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        decode_done = self._decode_with_kernel(query, kv_cache, metadata, scale, out, window, cap)
        prefill_done = self._prefill_with_kernel(query, kv_cache, metadata, scale, out, window, cap)
        start = 0
        lens = zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        for i, (q_len, s_len) in enumerate(lens):
            rows = slice(start, start + q_len)
            start += q_len
            if q_len == 0 or (q_len == 1 and decode_done) or (q_len > 1 and prefill_done):
                continue
            win = window if window is not None and window < s_len else None
            plain = win is None and cap is None
            if q_len == s_len:
                if plain:
                    out[rows] = _self_causal(query[rows], key[rows], value[rows], scale)
                else:
                    out[rows] = _attend_chunked(query[rows], key[rows].transpose(0, 1),
                                                value[rows].transpose(0, 1), scale, win, cap)
                continue
            first = 0 if win is None else max(0, s_len - q_len - win + 1)  # first key in a window
            k_ctx, v_ctx = _gather_request(kv_cache, metadata.block_table[i], s_len, first)
            if q_len == 1:
                out[rows] = _decode_one(query[rows], k_ctx, v_ctx, scale, cap)
            elif plain:
                out[rows] = _attend_with_context(query[rows], k_ctx, v_ctx, scale)
            else:
                out[rows] = _attend_chunked(query[rows], k_ctx, v_ctx, scale, win, cap)
        return out


    def _pure_decode(
        self,
        query: torch.Tensor,  # [num_reqs, num_heads, head_dim]: one token per request
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None,
        cap: float | None,
    ) -> torch.Tensor | None:
        """A pure decode step (every request one token) in one kernel call that reads the query
        as it is (bf16 or float32, token rows with contiguous heads) and returns the output in
        its dtype, with no per-request Python work; None where the kernel does not apply."""
        if (metadata.max_query_len != 1 or query.shape[0] != metadata.num_reqs
                or not _decode_kernel_applies(query, kv_cache)):
            return None
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        layout = (query.shape, query.stride(), query.dtype, kv_cache.shape, kv_cache.dtype,
                  kv_cache.is_contiguous(), window, cap)
        checked = self._decode_checked
        if checked is None or checked[0] is not metadata or checked[2:] != layout:
            table = metadata.block_table.contiguous()  # once per step, not once per layer
            paged_decode_kernel.check_inputs(query, kv_cache, table, metadata.seq_lens, window, cap)
            checked = self._decode_checked = (metadata, table, *layout)
        step_table = checked[1]
        assert isinstance(step_table, torch.Tensor)
        return paged_decode_kernel.paged_decode_checked(query, kv_cache, step_table,
                                                        metadata.seq_lens, scale, window, cap)

    def _decode_with_kernel(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], filled for decode rows
        window: int | None,
        cap: float | None,
    ) -> bool:
        """All single-token requests at once through the compiled CPU kernel, when it applies
        (a float32 or bfloat16 cache on the CPU, kernel built); returns whether it handled them.
        The kernel takes the sliding window and the soft cap itself, and computes in float32:
        it widens a bf16 query itself and rounds its output back to bf16."""
        if not _decode_kernel_applies(query, kv_cache):
            return False
        decode = [i for i, q_len in enumerate(metadata.query_lens_cpu) if q_len == 1]
        if not decode:
            return True
        starts = metadata.query_start_loc[:-1].long()
        idx = torch.tensor(decode, dtype=torch.long)
        rows = starts[idx]
        out[rows] = paged_decode_kernel.paged_decode(
            query[rows], kv_cache, metadata.block_table[idx].contiguous(),
            metadata.seq_lens[idx].contiguous(), scale, window, cap)
        return True


    @staticmethod
    def _prefill_with_kernel(
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], filled for multi-token rows
        window: int | None,
        cap: float | None,
    ) -> bool:
        """All multi-token requests (fresh prompts and chunks after cached context) at once
        through the compiled prefill kernel, when it applies (bf16 query and cache on a CPU with
        AVX512-BF16, or float32 on one with AVX-512F; no window or cap in this layer); returns
        whether it handled them.
        Their K/V are in the cache already (written above)."""
        if metadata.max_query_len <= 1:  # a pure decode step: nothing to do, no per-request loop
            return True
        if (window is not None or cap is not None or query.device.type != "cpu"
                or query.dtype != kv_cache.dtype
                or not paged_prefill_kernel.supports(query.shape[1], kv_cache.shape[3],
                                                     query.shape[2], kv_cache.shape[2], query.dtype)):
            return False
        starts, q_lens, seq_lens, idx = [], [], [], []
        start = 0
        for i, (q_len, s_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu,
                                               strict=True)):
            if q_len > 1:
                starts.append(start)
                q_lens.append(q_len)
                seq_lens.append(s_len)
                idx.append(i)
            start += q_len
        if idx:
            table = metadata.block_table
            if len(idx) != metadata.num_reqs:
                table = table[torch.tensor(idx, dtype=torch.long)]
            paged_prefill_kernel.paged_prefill(query, kv_cache, table.contiguous(), starts, q_lens,
                                               seq_lens, scale, out)
        return True


def _decode_kernel_applies(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the compiled decode kernel takes this query and cache: CPU tensors of dtypes it
    reads, sizes within its buffers, the kernel built."""
    return (query.device.type == "cpu" and query.dtype in paged_decode_kernel.QUERY_DTYPES
            and kv_cache.dtype in paged_decode_kernel.KV_DTYPES
            and paged_decode_kernel.available()
            and paged_decode_kernel.supports(query.shape[1], query.shape[2], kv_cache.shape[2]))


def write_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's K and V at its slot (`block_id * block_size + offset`): one C call on
    the CPU (a row copy, kernels/cpu/fused_ops.c), else the PyTorch indexed assignment."""
    if fused_ops.write_kv_applies(kv_cache, key, value, slot_mapping):
        fused_ops.write_kv(kv_cache, key, value, slot_mapping)
    else:
        fused_ops.write_kv_reference(kv_cache, key, value, slot_mapping)


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[q_len, num_heads, d] -> [num_kv_heads, q_len * group, d] (rows: token-major)."""
    q_len, num_heads, d = q.shape
    group = num_heads // num_kv_heads
    folded = q.view(q_len, num_kv_heads, group, d).permute(1, 0, 2, 3)
    return folded.reshape(num_kv_heads, q_len * group, d)


def _unfold_gqa(o: torch.Tensor, q_len: int) -> torch.Tensor:
    """Inverse of `_fold_gqa`: [num_kv_heads, q_len * group, d] -> [q_len, num_heads, d]."""
    kvh, rows, d = o.shape
    return o.view(kvh, q_len, rows // q_len, d).permute(1, 0, 2, 3).reshape(q_len, -1, d)


def _self_causal(
    q: torch.Tensor,  # [n, num_heads, d]
    k: torch.Tensor,  # [n, num_kv_heads, d]
    v: torch.Tensor,  # [n, num_kv_heads, d]
    scale: float,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True,
    )  # [1, num_heads, n, d]
    return out[0].transpose(0, 1)


def _gather_request(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, d]
    block_row: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's cached K and V at positions `first .. seq_len - 1`, each
    [kv_heads, seq_len - first, d]; blocks wholly before `first` are not read."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    if first == 0:
        ids = block_row[:num_blocks].long()
        k, v = (_gather_blocks(kv_cache, ids, kv).flatten(0, 1)[:seq_len] for kv in (0, 1))
    else:
        skip = first % block_size
        ids = block_row[first // block_size:num_blocks].long()
        k, v = (_gather_blocks(kv_cache, ids, kv).flatten(0, 1)[skip:skip + seq_len - first]
                for kv in (0, 1))
    return k.transpose(0, 1), v.transpose(0, 1)


def _gather_blocks(kv_cache: torch.Tensor, ids: torch.Tensor, kv: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of the blocks `ids`, contiguous: [len(ids), block_size, kvh, d]."""
    return kv_cache.select(1, kv).index_select(0, ids)


def _attend_with_context(
    q: torch.Tensor,  # [q_len, num_heads, d], the last q_len positions of the context
    k: torch.Tensor,  # [kv_heads, seq_len, d]
    v: torch.Tensor,  # [kv_heads, seq_len, d]
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Bottom-right causal attention (positions relative to the first key), optionally under
    a sliding window and a soft cap; returns [q_len, num_heads, d]."""
    q_len, seq_len = q.shape[0], k.shape[1]
    group = q.shape[1] // k.shape[0]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).repeat_interleave(group)
    # [q_len * group, seq_len]: True where the key position is visible
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    folded = _fold_gqa(q, k.shape[0])  # [kv_heads, q_len * group, d]
    if cap is not None:
        return _unfold_gqa(_capped_attention(folded, k, v, mask, scale, cap), q_len)
    out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=mask, scale=scale)
    return _unfold_gqa(out[0], q_len)


def _attend_chunked(
    q: torch.Tensor,  # [q_len, num_heads, d], the last q_len positions of the keys
    k: torch.Tensor,  # [kv_heads, n_keys, d]
    v: torch.Tensor,  # [kv_heads, n_keys, d]
    scale: float,
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    """`_attend_with_context` over chunks of `_QUERY_CHUNK` new tokens, each given only the
    keys from its first token's window start (or 0 without a window) to its last token;
    returns [q_len, num_heads, d]."""
    q_len, n_keys = q.shape[0], k.shape[1]
    if q_len <= _QUERY_CHUNK:
        lo = 0 if window is None else max(0, n_keys - q_len - window + 1)
        return _attend_with_context(q, k[:, lo:], v[:, lo:], scale, window, cap)
    out = torch.empty_like(q)
    for j0 in range(0, q_len, _QUERY_CHUNK):
        j1 = min(j0 + _QUERY_CHUNK, q_len)
        hi = n_keys - q_len + j1  # one past the chunk's last position
        lo = 0 if window is None else max(0, hi - (j1 - j0) - window + 1)
        out[j0:j1] = _attend_with_context(q[j0:j1], k[:, lo:hi], v[:, lo:hi], scale, window, cap)
    return out


def _capped_attention(
    q: torch.Tensor,  # [kv_heads, rows, d] (GQA-folded)
    k: torch.Tensor,  # [kv_heads, n_keys, d]
    v: torch.Tensor,  # [kv_heads, n_keys, d]
    mask: torch.Tensor,  # [rows, n_keys] bool, True = visible; every row sees a key
    scale: float,
    cap: float,
) -> torch.Tensor:
    """softmax(mask(cap * tanh(q k^T * scale / cap))) v in explicit matmuls (SDPA has no soft
    cap); the softmax in float32 at least. Returns [kv_heads, rows, d]."""
    scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale / cap).tanh_().mul_(cap)
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.matmul(probs.to(v.dtype), v)


def _decode_one(
    q: torch.Tensor,  # [1, num_heads, d]
    k: torch.Tensor,  # [kv_heads, seq_len, d]
    v: torch.Tensor,  # [kv_heads, seq_len, d]
    scale: float,
    cap: float | None = None,
) -> torch.Tensor:
    """One decode token over the context it sees (all of `k`, so a sliding window is applied
    by gathering only its keys): no mask; plain matmuls beat SDPA here."""
    kvh, d = k.shape[0], k.shape[2]
    # [kv_heads, group, seq_len]
    scores = torch.matmul(q.view(kvh, -1, d), k.transpose(1, 2)).mul_(scale)
    if cap is not None:
        scores = scores.div_(cap).tanh_().mul_(cap)
    return torch.matmul(scores.softmax(-1), v).view(1, -1, d)


def reference_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Naive token-by-token paged attention (any dtype, float64 included), for tests.

    Writes the new K/V slot by slot, then for each new token reads its request's context
    position by position through the block table and computes softmax(q k^T * scale) v over
    the keys it sees (its own position and the `sliding_window - 1` before it, or all before
    it without a window), scores soft-capped when `logits_soft_cap` is set. Only positions
    some new token sees are read.
    """
    window, cap = check_attention_options(sliding_window, logits_soft_cap)
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    for t, slot in enumerate(metadata.slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // block_size, 0, slot % block_size] = key[t]
            kv_cache[slot // block_size, 1, slot % block_size] = value[t]
    out = torch.zeros_like(query)
    start = 0
    lens = zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    for i, (q_len, s_len) in enumerate(lens):
        if q_len == 0:
            continue
        blocks = metadata.block_table[i].tolist()
        first = 0 if window is None else max(0, s_len - q_len - window + 1)
        slots = [(blocks[p // block_size], p % block_size) for p in range(first, s_len)]
        ks = torch.stack([kv_cache[b, 0, o] for b, o in slots])  # [s_len - first, kv_heads, d]
        vs = torch.stack([kv_cache[b, 1, o] for b, o in slots])
        for j in range(q_len):
            pos = s_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            keys = slice(lo - first, pos + 1 - first)
            for h in range(num_heads):
                scores = ks[keys, h // group] @ query[start + j, h] * scale  # [pos + 1 - lo]
                if cap is not None:
                    scores = torch.tanh(scores / cap) * cap
                out[start + j, h] = torch.softmax(scores, dim=0) @ vs[keys, h // group]
        start += q_len
    return out
