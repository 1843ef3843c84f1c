"""Shared cases for the sliding-window / soft-cap attention tests (backends and kernels).

- `make_batch`: a varlen paged batch of requests given as (cached context, new tokens), block ids
  shuffled over the cache, the context pre-filled with random K/V, the null block 0 unused.
- `free_out_of_window`: what the KV cache manager does to blocks every query of the step is past:
  their block-table entries become the null block 0, which (like the freed blocks themselves) is
  filled with NaN, so any read of them shows in the output.
- `dense_attention` / `dense_batch`: plain masked attention in float64 on unpaged tensors, with
  the semantics of transformers (`q - window < k <= q`, `cap * tanh(scores / cap)` before the mask).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from engine.attention.backend import AttentionMetadata

Req = tuple[int, int]  # (cached context, new tokens)
KernelArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim], context only
    metadata: AttentionMetadata
    reqs: list[Req]

    def clone_cache(self) -> torch.Tensor:
        return self.cache.clone()

    def written_cache(self) -> torch.Tensor:
        """A copy of the cache with this step's K/V stored at their slots (what kernels read)."""
        cache = self.cache.clone()
        bs = cache.shape[2]
        for t, slot in enumerate(self.metadata.slot_mapping.tolist()):
            cache[slot // bs, 0, slot % bs] = self.key[t]
            cache[slot // bs, 1, slot % bs] = self.value[t]
        return cache

    def kernel_args(self, cache: torch.Tensor | None = None) -> KernelArgs:
        """query, kv_cache, block_table, query_start_loc, seq_lens: the first arguments of the
        prefill kernel and its reference (the new K/V already written into kv_cache)."""
        md = self.metadata
        return (self.query, self.written_cache() if cache is None else cache, md.block_table,
                md.query_start_loc, md.seq_lens)


def make_batch(reqs: list[Req], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> Batch:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = sum(per_req) + 2  # + the null block 0 and a spare one
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    table = torch.zeros(len(reqs), max(per_req) + 1, dtype=torch.int32)  # a spare column of padding
    slots: list[int] = []
    for i, ((ctx, new), n_blocks) in enumerate(zip(reqs, per_req, strict=True)):
        blocks = [free.pop() for _ in range(n_blocks)]
        table[i, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
    q_lens = [n for _, n in reqs]
    s_lens = [c + n for c, n in reqs]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    n_tok = starts[-1]
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g)
    cache[0] = 0.0
    query = torch.randn(n_tok, num_heads, head_dim, generator=g)
    key = torch.randn(n_tok, num_kv_heads, head_dim, generator=g)
    value = torch.randn(n_tok, num_kv_heads, head_dim, generator=g)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), max_query_len=max(q_lens), max_seq_len=max(s_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=s_lens)
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return Batch(put(query), put(key), put(value), put(cache), metadata, list(reqs))


def first_needed(ctx: int, new: int, window: int | None) -> int:
    """First position any new token of a request sees (the first new token's window start)."""
    return 0 if window is None else max(0, ctx - window + 1)


def free_out_of_window(batch: Batch, window: int) -> tuple[Batch, int]:
    """The batch as the cache manager leaves it once blocks fall out of every layer's window:
    table entries of blocks wholly before each request's first needed position point at the
    null block 0, and block 0 and the freed blocks hold NaN. Returns it and how many entries
    were nulled (tests assert this is > 0 where they mean to exercise it)."""
    md = batch.metadata
    bs = batch.cache.shape[2]
    cache = batch.cache.clone()
    table = md.block_table.clone()
    cache[0] = float("nan")
    nulled = 0
    for i, (ctx, new) in enumerate(batch.reqs):
        for b in range(first_needed(ctx, new, window) // bs):
            cache[int(table[i, b])] = float("nan")
            table[i, b] = 0
            nulled += 1
    return replace(batch, cache=cache, metadata=replace(md, block_table=table)), nulled


def dense_attention(
    q: torch.Tensor,  # [q_len, num_heads, d], at positions seq_len - q_len .. seq_len - 1
    k: torch.Tensor,  # [seq_len, num_kv_heads, d], positions 0 .. seq_len - 1
    v: torch.Tensor,  # [seq_len, num_kv_heads, d]
    scale: float,
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    """Masked softmax attention in float64 on dense tensors; returns [q_len, num_heads, d]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kk = k.double().repeat_interleave(group, dim=1)  # [seq, heads, d]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def dense_batch(batch: Batch, scale: float, window: int | None, cap: float | None) -> torch.Tensor:
    """`dense_attention` per request of the batch, K/V read from the original (unfreed) cache
    and the new tokens; returns [num_tokens, num_heads, head_dim] float64."""
    md = batch.metadata
    bs = batch.cache.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    start = 0
    for i, (ctx, new) in enumerate(batch.reqs):
        pos = torch.arange(ctx)
        blocks = md.block_table[i].cpu().long()[pos // bs]
        cache = batch.cache.cpu()
        rows = slice(start, start + new)
        k = torch.cat([cache[blocks, 0, pos % bs], batch.key[rows].cpu()])  # [ctx + new, kvh, d]
        v = torch.cat([cache[blocks, 1, pos % bs], batch.value[rows].cpu()])
        if new:
            out[rows] = dense_attention(batch.query[rows].cpu(), k, v, scale, window, cap)
        start += new
    return out
