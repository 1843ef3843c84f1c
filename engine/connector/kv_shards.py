"""KV in the store under tensor parallelism: each rank's head shard is its own object, under the
LMCache key of that rank (`model@world_size@worker_id@hash@dtype`, the real world size and the
rank as worker id), and a consumer of another TP size re-shards on load.

    rank_key(key, 2, 1)          # the key of rank 1 of 2 for the chunk of `key`
    world_of(key)                # the world size a key was made for
    heads = HeadSplit(kv_heads=2, world=4)
    heads.of(3)                  # (1, 1): rank 3 of 4 holds KV head 1 (replicated on ranks 2, 3)
    heads.sources()              # [0, 2]: the ranks whose objects hold every head once

Ranks split the KV heads as the model splits them (engine/parallel/shard.py `kv_head_range`):
with `world` at most the number of KV heads, each rank a contiguous run, as even as it goes (3
heads on 2 ranks: 2 + 1); with more ranks than KV heads, each head is on world / KV ranks (rank r
holds head r // (world / KV)).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.shard import kv_head_range
from kvstore.backend import KVObject


def rank_key(key: str, world: int, rank: int) -> str:
    """`key` (a chunk key, a layer suffix allowed) with world size `world` and worker id `rank`."""
    parts = key.split("@")
    parts[1], parts[2] = str(world), str(rank)
    return "@".join(parts)


def world_of(key: str) -> int:
    return int(key.split("@")[1])


def every_rank(keys: Sequence[str]) -> list[str]:
    """Each key under every rank of its world size (what a lease or a release covers)."""
    return [rank_key(k, world_of(k), r) for k in keys for r in range(world_of(k))]


@dataclass(frozen=True)
class HeadSplit:
    kv_heads: int
    world: int

    def of(self, rank: int) -> tuple[int, int]:
        """(first KV head, count) held by `rank` (the model's split, engine/parallel/shard.py)."""
        return kv_head_range(self.kv_heads, self.world, rank)

    def sources(self) -> list[int]:
        """The ranks whose shards, side by side, hold every KV head once."""
        if self.world <= self.kv_heads:
            return list(range(self.world))
        return [h * (self.world // self.kv_heads) for h in range(self.kv_heads)]


def assemble(parts: Sequence[torch.Tensor], split: HeadSplit, head_dim: int) -> torch.Tensor:
    """The source ranks' KV_T2D shards `[n, 2, heads_r * head_dim]` (in `split.sources()` order)
    as one `[n, 2, kv_heads * head_dim]` tensor."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(list(parts), dim=2)


def shard_of(full: torch.Tensor, split: HeadSplit, rank: int, head_dim: int) -> torch.Tensor:
    """Rank `rank`'s heads of a whole `[n, 2, kv_heads * head_dim]` KV_T2D tensor."""
    first, count = split.of(rank)
    if count == split.kv_heads:
        return full
    return full[:, :, first * head_dim:(first + count) * head_dim]


@dataclass
class ShardLayout:
    """This engine's side: its tensor-parallel size and the model's KV heads (set once the
    caches are registered)."""

    world: int = 1
    kv_heads: int = 0
    head_dim: int = 0


@dataclass
class ShardParts:
    """One (chunk, layer) of a source of `world` ranks: its source ranks' objects, each copied
    out of the reader's buffer, under their own keys."""

    world: int
    ranks: list[int]
    keys: list[str]
    objects: list[Any]

    @property
    def data(self) -> bytes:  # (counted as loaded bytes)
        return b"".join(bytes(o.data) for o in self.objects)


class ShardReader:
    """A store client's `get_stream` over chunk keys of any world size: a key of world 1 read by an
    engine of 1 rank is read as it is; any other is read as the objects of its source ranks
    (`HeadSplit.sources`), yielded together as one ShardParts (None when one is missing)."""

    def __init__(self, inner: Any, layout: ShardLayout) -> None:
        self.inner = inner
        self.layout = layout

    def get_stream(self, keys: Sequence[str], batch: int = 8) -> Iterator[tuple[int, Any]]:
        if self.layout.world == 1 and all(world_of(k) == 1 for k in keys):
            yield from self.inner.get_stream(keys, batch=batch)
            return
        physical: list[str] = []
        owner: list[tuple[int, int]] = []  # per physical key: (logical index, source rank)
        for i, key in enumerate(keys):
            world = world_of(key)
            if not 1 <= world <= 64:  # (transfer_params refuses such keys before they get here)
                raise ValueError(f"a KV key of world size {world}: {key!r}")
            for r in HeadSplit(self.layout.kv_heads, world).sources():
                physical.append(rank_key(key, world, r))
                owner.append((i, r))
        parts: dict[int, ShardParts] = {}
        missing: set[int] = set()
        per_key = len(physical) // max(1, len(keys))
        for j, obj in self.inner.get_stream(physical, batch=batch * per_key):
            i, r = owner[j]
            part = parts.setdefault(i, ShardParts(world_of(keys[i]), [], [], []))
            if obj is None:
                missing.add(i)
            else:  # the reader's buffer is reused for the next object: keep a copy
                part.ranks.append(r)
                part.keys.append(physical[j])
                part.objects.append(KVObject(bytes(obj.metadata), bytes(obj.data), bytes(obj.checksum)))
            if j + 1 == len(physical) or owner[j + 1][0] != i:
                done = parts.pop(i)
                yield i, None if i in missing else done
