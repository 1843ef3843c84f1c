"""The storage interface every KV store backend implements (memory, redis), and its errors.

An object is one LMCache-style entry: a small metadata header (`RemoteMetadata` bytes, or
whatever the writer put there; the store does not interpret it), a payload (the raw KV
bytes) and the producer's checksum of them (opaque to the store; kvstore/integrity.py).
Keys are strings (LMCache `CacheEngineKey` / `LayerCacheEngineKey` strings for KV data).

Contract, for every backend:
- `put` is atomic: a reader sees either no object or the complete new one, never a part.
- `get` returns the object or None; it counts a hit or a miss and refreshes LRU recency.
- Leased and pinned objects are never evicted; a lease ends at its deadline or on `release`.
- Methods are thread-safe (the server calls them from gRPC worker threads).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Buffer(Protocol):
    """Anything exposing the buffer protocol with a length: bytes, memoryview, pyarrow.Buffer."""

    def __len__(self) -> int: ...


class KVStoreError(Exception):
    """Base of the store's errors; the message is shown to the client as is."""


class ObjectTooLargeError(KVStoreError):
    """The object is larger than the backend's max object size (or its whole capacity)."""


class CapacityError(KVStoreError):
    """The object does not fit even after evicting every evictable object."""


class InvalidRequestError(KVStoreError):
    """Malformed key or arguments."""


@dataclass(frozen=True)
class KVObject:
    metadata: bytes
    data: Buffer  # bytes or pyarrow.Buffer; never copied by the memory backend
    # The producer's keyed checksum (kvstore/integrity.py), kept and returned as is; b"" = none
    # (LMCache clients send none). The store cannot check it: it does not hold the key.
    checksum: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.metadata) + len(self.data) + len(self.checksum)


@dataclass(frozen=True)
class BackendStats:
    objects: int
    bytes_used: int
    capacity_bytes: int  # 0 = unbounded / unknown (redis)
    hits: int
    misses: int
    evictions: int
    leased: int
    pinned: int


class Backend(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    def put(self, key: str, obj: KVObject, ttl_s: float | None = None) -> None:
        """Stores (or replaces) `key` atomically. Raises ObjectTooLargeError / CapacityError."""

    @abc.abstractmethod
    def get(self, key: str) -> KVObject | None: ...

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, without counting hits or misses."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Deletes the keys (leases and pins go with them); returns how many existed."""

    @abc.abstractmethod
    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        """Protects present keys from eviction for `ttl_s` seconds (extends an existing lease);
        returns how many keys were present and are now leased."""

    @abc.abstractmethod
    def release(self, keys: Sequence[str]) -> int:
        """Ends the leases on `keys`; returns how many were leased."""

    @abc.abstractmethod
    def pin(self, keys: Sequence[str]) -> int:
        """Protects present keys from eviction until `unpin`; returns how many were pinned."""

    @abc.abstractmethod
    def unpin(self, keys: Sequence[str]) -> int: ...

    @abc.abstractmethod
    def stats(self) -> BackendStats: ...

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first on, are all present (a chunk chain's cached
        prefix)."""
        n = 0
        for present in self.exists(keys):
            if not present:
                break
            n += 1
        return n

    def probe(self) -> None:
        """Raises when the backend cannot serve (the server's health action); the default asks
        whether one key exists."""
        self.exists(["pdserve-health-probe"])

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections; the default has none."""
