"""Copies between the paged KV cache and LMCache KV_T2D objects `[tokens, 2, kv_heads *
head_dim]` (the KV store connector's worker half), the check of a loaded object's metadata, and
its timings for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks, pos % block_size


def gather_tokens(kv_cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    """KV of positions [start, end) as a new KV_T2D tensor [n, 2, kv_heads * head_dim] (CPU)."""
    blocks, offs = _slots(block_ids, start, end, kv_cache.shape[2])
    data = kv_cache[blocks.to(kv_cache.device), :, offs.to(kv_cache.device)]  # [n, 2, kvh, d]
    return data.reshape(end - start, 2, -1).to("cpu", copy=True).contiguous()


def scatter_tokens(kv_cache: torch.Tensor, block_ids: list[int], start: int,
                   data: torch.Tensor) -> None:
    """Writes KV_T2D `data` [n, 2, kv_heads * head_dim] at positions [start, start + n).
    Whole blocks go in one `index_copy_` (a strided copy per block, ~3x faster than a
    per-token scatter); a partial block at either end goes token by token."""
    n = data.shape[0]
    bs, kvh, hd = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    first = min(n, -start % bs)  # tokens before the first block boundary
    whole = (n - first) // bs
    if whole == 0:
        _scatter_slots(kv_cache, block_ids, start, data)
        return
    if first:
        _scatter_slots(kv_cache, block_ids, start, data[:first])
    b0 = (start + first) // bs
    idx = torch.tensor(block_ids[b0:b0 + whole], dtype=torch.long, device=kv_cache.device)
    src = data[first:first + whole * bs].reshape(whole, bs, 2, kvh, hd).permute(0, 2, 1, 3, 4)
    kv_cache.index_copy_(0, idx, src.to(kv_cache.device))
    tail = first + whole * bs
    if tail < n:
        _scatter_slots(kv_cache, block_ids, start + tail, data[tail:])


def _scatter_slots(kv_cache: torch.Tensor, block_ids: list[int], start: int,
                   data: torch.Tensor) -> None:
    n = data.shape[0]
    blocks, offs = _slots(block_ids, start, start + n, kv_cache.shape[2])
    shaped = data.reshape(n, 2, kv_cache.shape[3], kv_cache.shape[4])
    kv_cache[blocks.to(kv_cache.device), :, offs.to(kv_cache.device)] = shaped.to(kv_cache.device)


@dataclass
class WorkerTimings:
    """Seconds spent, for benchmarks: waits for saves at the end of steps (the save tail) and
    each request's load."""

    save_waits: list[float] = field(default_factory=list)
    loads: dict[str, float] = field(default_factory=dict)
    keep: int = 1000  # the most recent entries only (a long-running server)

    def record_load(self, req_id: str, seconds: float) -> None:
        self.loads[req_id] = seconds
        if len(self.loads) > self.keep:
            del self.loads[next(iter(self.loads))]
        del self.save_waits[:-self.keep]


def check_object(obj: Any, width: int, dtype: str, first: int, hi: int) -> tuple[str | None, int]:
    """(what is wrong with a loaded KV object, or None; its token count): LMCache metadata for a
    KV_T2D tensor [n, 2, width] of `dtype` that reaches token `hi` from token `first`."""
    from kvstore.lmcache_format import RemoteMetadata

    try:
        meta = RemoteMetadata.unpack(obj.metadata)
    except ValueError as exc:
        return f"has bad metadata: {exc}", 0
    shape = meta.shapes[0]
    n = shape[0]
    if (meta.length != len(obj.data) or tuple(shape[1:]) != (2, width) or meta.dtypes[0] != dtype
            or first + n < hi):
        return f"does not match ({meta.length} bytes, shape {shape})", n
    return None, n
