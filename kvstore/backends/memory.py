"""The embedded backend: objects in process memory, bounded by bytes, LRU eviction.

Accounting is by `KVObject.nbytes` (metadata + payload); `bytes_used` never exceeds the capacity.
A put evicts least-recently-used objects that are neither leased nor pinned until the new object
fits; when even evicting every evictable object would not make room it raises CapacityError and
evicts nothing. Payloads are stored as given (never copied).

Expiry follows the Redis backend so both behave alike: an object put with a TTL expires at its
deadline (checked lazily on access, and swept on every put); a lease extends an existing TTL to at
least the lease's end (it never adds one); a pin removes the TTL, and unpin restores the default
TTL, if there is one, counted from the unpin.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.backend import (
    Backend,
    BackendStats,
    CapacityError,
    InvalidRequestError,
    KVObject,
    ObjectTooLargeError,
)

EvictCallback = Callable[[int, int], None]  # (objects evicted, bytes freed)
_NEVER = float("-inf")


@dataclass
class _Entry:
    obj: KVObject
    nbytes: int
    expires_at: float | None  # clock time; None = no TTL


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, capacity_bytes: int, max_object_bytes: int | None = None,
                 default_ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_evict: EvictCallback | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if max_object_bytes is not None and max_object_bytes <= 0:
            raise ValueError(f"max_object_bytes must be positive, got {max_object_bytes}")
        if default_ttl_s is not None and default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.max_object_bytes = min(max_object_bytes or capacity_bytes, capacity_bytes)
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._leases: dict[str, float] = {}  # key -> lease deadline (clock time)
        self._pinned: set[str] = set()
        self._expiry_heap: list[tuple[float, str]] = []  # may hold stale items; see _sweep
        self._bytes_used = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, obj: KVObject, ttl_s: float | None = None) -> None:
        _check_key(key)
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive, got {ttl_s}")
        nbytes = obj.nbytes
        if nbytes > self.max_object_bytes:
            raise ObjectTooLargeError(f"object {key[:200]!r} is {nbytes} bytes; this store takes at "
                                      f"most {self.max_object_bytes} bytes per object")
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        with self._lock:
            now = self._clock()
            self._sweep(now)
            victims = self._victims_for(key, nbytes, now)
            freed = sum(self._remove(victim) for victim in victims)
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes_used -= old.nbytes
            expires_at = None if ttl is None or key in self._pinned else now + ttl
            self._entries[key] = _Entry(obj, nbytes, expires_at)
            self._bytes_used += nbytes
            if expires_at is not None:
                self._push_expiry(expires_at, key)
            self._evictions += len(victims)
        if victims and self._on_evict is not None:
            self._on_evict(len(victims), freed)

    def delete(self, keys: Sequence[str]) -> int:
        with self._lock:
            now = self._clock()
            existed = 0
            for key in keys:
                entry = self._live(key, now)
                if entry is not None:
                    self._remove(key)
                    existed += 1
            return existed

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> KVObject | None:
        with self._lock:
            entry = self._live(key, self._clock())
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry.obj

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            now = self._clock()
            return [self._live(key, now) is not None for key in keys]

    # -- protection -----------------------------------------------------------------------------

    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        if ttl_s <= 0:
            raise InvalidRequestError(f"lease ttl_s must be positive, got {ttl_s}")
        with self._lock:
            now = self._clock()
            deadline = now + ttl_s
            leased = 0
            for key in keys:
                entry = self._live(key, now)
                if entry is None:
                    continue
                self._leases[key] = max(self._leases.get(key, deadline), deadline)
                if entry.expires_at is not None and entry.expires_at < deadline:
                    entry.expires_at = deadline
                    self._push_expiry(deadline, key)
                leased += 1
            return leased

    def release(self, keys: Sequence[str]) -> int:
        with self._lock:
            now = self._clock()
            released = 0
            for key in keys:
                deadline = self._leases.pop(key, None)
                if deadline is not None and deadline > now and self._live(key, now) is not None:
                    released += 1
            return released

    def pin(self, keys: Sequence[str]) -> int:
        with self._lock:
            now = self._clock()
            pinned = 0
            for key in keys:
                entry = self._live(key, now)
                if entry is None:
                    continue
                self._pinned.add(key)
                entry.expires_at = None
                pinned += 1
            return pinned

    def unpin(self, keys: Sequence[str]) -> int:
        with self._lock:
            now = self._clock()
            unpinned = 0
            for key in keys:
                if key not in self._pinned:
                    continue
                self._pinned.discard(key)
                unpinned += 1
                entry = self._entries.get(key)
                if entry is not None and self.default_ttl_s is not None:
                    entry.expires_at = now + self.default_ttl_s
                    self._push_expiry(entry.expires_at, key)
            return unpinned

    def stats(self) -> BackendStats:
        with self._lock:
            now = self._clock()
            for key in [k for k, deadline in self._leases.items() if deadline <= now]:
                del self._leases[key]
            return BackendStats(objects=len(self._entries), bytes_used=self._bytes_used,
                                capacity_bytes=self.capacity_bytes, hits=self._hits,
                                misses=self._misses, evictions=self._evictions,
                                leased=len(self._leases), pinned=len(self._pinned))

    # -- internals (caller holds the lock) ------------------------------------------------------

    def _live(self, key: str, now: float) -> _Entry | None:
        """The entry for `key`, dropping it first if its TTL has passed."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
            self._remove(key)
            return None
        return entry

    def _victims_for(self, key: str, nbytes: int, now: float) -> list[str]:
        """LRU-first evictable keys whose removal makes room for `nbytes` under `key` (whose old
        object, if any, is replaced). Raises CapacityError, changing nothing, if they cannot."""
        old = self._entries.get(key)
        free = self.capacity_bytes - self._bytes_used + (old.nbytes if old is not None else 0)
        victims: list[str] = []
        for candidate, entry in self._entries.items():
            if free >= nbytes:
                break
            if candidate == key or candidate in self._pinned or self._leases.get(candidate, _NEVER) > now:
                continue
            victims.append(candidate)
            free += entry.nbytes
        if free < nbytes:
            raise CapacityError(f"no room for {key[:200]!r} ({nbytes} bytes): {self._bytes_used} of "
                                f"{self.capacity_bytes} bytes in use, the rest held by leased or "
                                f"pinned objects")
        return victims

    def _remove(self, key: str) -> int:
        entry = self._entries.pop(key)
        self._bytes_used -= entry.nbytes
        self._leases.pop(key, None)
        self._pinned.discard(key)
        return entry.nbytes

    def _push_expiry(self, deadline: float, key: str) -> None:
        heapq.heappush(self._expiry_heap, (deadline, key))
        if len(self._expiry_heap) > 2 * len(self._entries) + 64:
            self._expiry_heap = [(e.expires_at, k) for k, e in self._entries.items()
                                 if e.expires_at is not None]
            heapq.heapify(self._expiry_heap)

    def _sweep(self, now: float) -> None:
        """Drops every object whose TTL has passed. Heap items whose object is gone or whose
        deadline moved are stale and skipped (every live deadline has its own item)."""
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            self._live(key, now)


def _check_key(key: str) -> None:
    if not key:
        raise InvalidRequestError("key must not be empty")
