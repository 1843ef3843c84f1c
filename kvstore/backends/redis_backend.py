"""A backend on a real Redis server, in LMCache 0.5.6's Redis layout.

LMCache's `RedisConnector` stores an object as two plain string keys, with no prefix:
`key + "metadata"` (the `RemoteMetadata` bytes) and `key + "kv_bytes"` (the payload). This
backend uses exactly those keys, so LMCache and pdserve read each other's objects. Unlike
LMCache, which sets the two keys one after the other, a put here writes both in one MULTI/EXEC
transaction and a get reads both in one, so a reader never sees half an object.
The producer's checksum (kvstore/integrity.py) goes in a third key, `key + "checksum"`,
written, read, expired and deleted with the other two; LMCache's two keys hold exactly what
LMCache writes, and an object without a checksum (an LMCache client's) has no third key.

Eviction belongs to Redis: its `maxmemory` / `maxmemory-policy` decide what goes when memory
runs out, and this backend cannot stop that. Protection is what Redis offers:
- pin: PERSIST both keys (no TTL) and record the key in the set `pdserve:pinned`; unpin removes
  it and restores the default TTL, if one is configured. A pinned key is safe from expiry, and
  from eviction under the `volatile-*` policies (they only evict keys with a TTL).
- lease: extends an existing TTL to at least the lease (`PEXPIRE .. GT`, never adds a TTL), and
  records the deadline in the sorted set `pdserve:leased` for `release` and `stats`.
Hits and misses are counted in this process. Needs Redis >= 7.0 (PEXPIRE GT).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis

from kvstore.backend import (
    Backend,
    BackendStats,
    Buffer,
    CapacityError,
    InvalidRequestError,
    KVObject,
    KVStoreError,
    ObjectTooLargeError,
)
from kvstore.chunked import contiguous
from kvstore.credentials import read_secret

META_SUFFIX = "metadata"
DATA_SUFFIX = "kv_bytes"
CHECKSUM_SUFFIX = "checksum"
PINNED_SET = "pdserve:pinned"
LEASED_ZSET = "pdserve:leased"
REDIS_MAX_BULK = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len


class RedisBackend(Backend):
    name = "redis"

    def __init__(self, url: str | None = None, *, host: str = "127.0.0.1", port: int = 6379,
                 db: int = 0, default_ttl_s: float | None = None, socket_timeout_s: float = 5.0,
                 max_object_bytes: int = REDIS_MAX_BULK, scan_limit: int = 100_000,
                 password: str | None = None) -> None:
        if default_ttl_s is not None and default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        options: dict[str, Any] = dict(socket_timeout=socket_timeout_s,
                                       socket_connect_timeout=socket_timeout_s)
        # Redis's AUTH password: the argument, else $PDSERVE_REDIS_PASSWORD(_FILE), so it never
        # has to sit in a URL on a command line; a password inside the URL still works.
        password = password or read_secret("PDSERVE_REDIS_PASSWORD")
        if password:
            options["password"] = password
        if url is not None:
            self._redis = redis.Redis.from_url(url, **options)
        else:
            self._redis = redis.Redis(host=host, port=port, db=db, **options)
        self.default_ttl_s = default_ttl_s
        self.max_object_bytes = max_object_bytes
        self.scan_limit = scan_limit
        self._counts_lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, obj: KVObject, ttl_s: float | None = None) -> None:
        _check_key(key)
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive, got {ttl_s}")
        payload = _as_bytes_like(contiguous(obj.data))
        if obj.nbytes > self.max_object_bytes:
            raise ObjectTooLargeError(f"object {key[:200]!r} is {obj.nbytes} bytes; this store takes "
                                      f"at most {self.max_object_bytes} bytes per object")
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        with _redis_errors():
            if ttl is not None and self._redis.sismember(PINNED_SET, key):
                ttl = None
            px = None if ttl is None else max(1, round(ttl * 1000))
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(key + DATA_SUFFIX, payload, px=px)
            pipe.set(key + META_SUFFIX, obj.metadata, px=px)
            if obj.checksum:
                pipe.set(key + CHECKSUM_SUFFIX, obj.checksum, px=px)
            else:  # none: no stale checksum of an earlier object under this key
                pipe.delete(key + CHECKSUM_SUFFIX)
            pipe.execute()

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key + META_SUFFIX, key + DATA_SUFFIX, key + CHECKSUM_SUFFIX)
            pipe.srem(PINNED_SET, *keys)
            pipe.zrem(LEASED_ZSET, *keys)
            removed = pipe.execute()[: len(keys)]
        return sum(1 for n in removed if n > 0)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> KVObject | None:
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(key + META_SUFFIX)
            pipe.get(key + DATA_SUFFIX)
            pipe.get(key + CHECKSUM_SUFFIX)
            metadata, data, checksum = pipe.execute()
        found = metadata is not None and data is not None
        with self._counts_lock:
            if found:
                self._hits += 1
            else:
                self._misses += 1
        return KVObject(metadata=metadata, data=data, checksum=checksum or b"") if found else None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key + META_SUFFIX, key + DATA_SUFFIX)
            counts = pipe.execute()
        return [n == 2 for n in counts]

    # -- protection -----------------------------------------------------------------------------

    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        if ttl_s <= 0:
            raise InvalidRequestError(f"lease ttl_s must be positive, got {ttl_s}")
        if not keys:
            return 0
        ms = max(1, round(ttl_s * 1000))
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=True)
            for key in keys:
                pipe.pexpire(key + META_SUFFIX, ms, gt=True)
                pipe.pexpire(key + DATA_SUFFIX, ms, gt=True)
                pipe.pexpire(key + CHECKSUM_SUFFIX, ms, gt=True)
                pipe.exists(key + META_SUFFIX, key + DATA_SUFFIX)
            present = [key for key, n in zip(keys, pipe.execute()[3::4], strict=True) if n == 2]
            if present:
                deadline_ms = _now_ms() + ms
                self._redis.zadd(LEASED_ZSET, {key: deadline_ms for key in present}, gt=True)
        return len(present)

    def release(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=True)
            pipe.zremrangebyscore(LEASED_ZSET, "-inf", _now_ms())
            pipe.zrem(LEASED_ZSET, *keys)
            return int(pipe.execute()[1])

    def pin(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=True)
            for key in keys:
                pipe.persist(key + META_SUFFIX)
                pipe.persist(key + DATA_SUFFIX)
                pipe.persist(key + CHECKSUM_SUFFIX)
                pipe.exists(key + META_SUFFIX, key + DATA_SUFFIX)
            present = [key for key, n in zip(keys, pipe.execute()[3::4], strict=True) if n == 2]
            if present:
                self._redis.sadd(PINNED_SET, *present)
        return len(present)

    def unpin(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with _redis_errors():
            pipe = self._redis.pipeline(transaction=True)
            for key in keys:
                pipe.srem(PINNED_SET, key)
            unpinned = [key for key, n in zip(keys, pipe.execute(), strict=True) if n]
            if unpinned and self.default_ttl_s is not None:
                ms = max(1, round(self.default_ttl_s * 1000))
                pipe = self._redis.pipeline(transaction=False)
                for key in unpinned:
                    pipe.pexpire(key + META_SUFFIX, ms, nx=True)
                    pipe.pexpire(key + DATA_SUFFIX, ms, nx=True)
                    pipe.pexpire(key + CHECKSUM_SUFFIX, ms, nx=True)
                pipe.execute()
        return len(unpinned)

    def stats(self) -> BackendStats:
        """objects: "*metadata" keys (SCAN, at most `scan_limit`); bytes_used: the server's
        used_memory; capacity: its maxmemory (0 = none); evictions: its evicted_keys (Redis keys,
        two or three per object)."""
        with _redis_errors():
            memory = self._redis.info("memory")
            evicted = self._redis.info("stats").get("evicted_keys", 0)
            pipe = self._redis.pipeline(transaction=False)
            pipe.zremrangebyscore(LEASED_ZSET, "-inf", _now_ms())
            pipe.zcard(LEASED_ZSET)
            pipe.scard(PINNED_SET)
            _, leased, pinned = pipe.execute()
            objects = self._count_objects()
        return BackendStats(objects=objects, bytes_used=int(memory.get("used_memory", 0)),
                            capacity_bytes=int(memory.get("maxmemory", 0)), hits=self._hits,
                            misses=self._misses, evictions=int(evicted), leased=int(leased),
                            pinned=int(pinned))

    def close(self) -> None:
        self._redis.close()

    def _count_objects(self) -> int:
        count = 0
        for _ in self._redis.scan_iter(match="*" + META_SUFFIX, count=1000):
            count += 1
            if count >= self.scan_limit:
                break
        return count


def _check_key(key: str) -> None:
    if not key:
        raise InvalidRequestError("key must not be empty")


def _as_bytes_like(data: Buffer) -> bytes | memoryview:
    """The payload as redis-py sends it unchanged: bytes, or a flat byte memoryview."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def _redis_errors() -> Iterator[None]:
    """Turns redis-py errors into the store's errors (OOM -> CapacityError)."""
    try:
        yield
    except redis.exceptions.ResponseError as exc:
        text = str(exc)
        if "OOM" in text or "maxmemory" in text:
            raise CapacityError(f"redis is out of memory: {text}") from exc
        raise KVStoreError(f"redis error: {text}") from exc
    except redis.exceptions.RedisError as exc:
        raise KVStoreError(f"redis unavailable: {exc}") from exc
