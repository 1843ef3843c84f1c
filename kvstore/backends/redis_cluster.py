"""A backend on a Redis Cluster: the data of every `pdserve kvstore` front-end lives in the
cluster, so any number of front-ends over one cluster serve the same objects and hold no state
of their own (only this process's hit and miss counts).

Keys: kvstore/backends/cluster_keys.py. In the default "slot" layout an object's metadata,
payload, checksum and protection markers share one hash slot, so a put and a get are each one
MULTI/EXEC on the master that owns the slot: a reader sees no object or the whole new one.

Protection is per object, beside it in its slot, so every front-end sees it:
- pin: PERSIST the object's keys and set its `pinned` marker (no TTL); unpin deletes the marker
  and restores the default TTL, if one is configured.
- lease: extend an existing TTL to at least the lease (`PEXPIRE .. GT`, never adds a TTL) and
  set its `leased` marker with the lease as its own TTL (a longer lease wins); release deletes
  the marker.
Eviction belongs to Redis (`maxmemory-policy` on each master), as in the one-server backend.

A master that is down (killed, partitioned) makes the calls on its slots fail with a
KVStoreError, which a client's KV connector takes as a miss or a dropped put; the other
masters keep serving when the cluster runs with `cluster-require-full-coverage no`.
Needs Redis >= 7.0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvstore.backend import (
    Backend,
    BackendStats,
    CapacityError,
    InvalidRequestError,
    KVObject,
    KVStoreError,
    ObjectTooLargeError,
)
from kvstore.backends.cluster_keys import KeyLayout, ObjectKeys
from kvstore.backends.redis_backend import REDIS_MAX_BULK, _as_bytes_like
from kvstore.chunked import contiguous
from kvstore.credentials import read_secret


class RedisClusterBackend(Backend):
    name = "redis-cluster"

    def __init__(self, url: str, *, layout: str = "slot", default_ttl_s: float | None = None,
                 socket_timeout_s: float = 5.0, max_object_bytes: int = REDIS_MAX_BULK,
                 scan_limit: int = 100_000, password: str | None = None) -> None:
        """`url`: redis://[user:password@]host:port[,host:port...] (startup nodes; any one
        that answers gives the whole cluster's map), rediss:// for TLS."""
        if default_ttl_s is not None and default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        self.layout = KeyLayout(layout)
        self.default_ttl_s = default_ttl_s
        self.max_object_bytes = max_object_bytes
        self.scan_limit = scan_limit
        nodes, options = parse_cluster_url(url)
        password = password or options.pop("password", None) or read_secret("PDSERVE_REDIS_PASSWORD")
        if password:
            options["password"] = password
        # Few, short retries: a call on a dead master's slot should fail fast (the client
        # recomputes), not wait out redis-py's default ten attempts.
        with _cluster_errors():  # asks a startup node for the slot map: fails if none answers
            self._redis = RedisCluster(
                startup_nodes=nodes, require_full_coverage=False, cluster_error_retry_attempts=2,
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
                socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, **options)
        self._counts_lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, obj: KVObject, ttl_s: float | None = None) -> None:
        if not key:
            raise InvalidRequestError("key must not be empty")
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive, got {ttl_s}")
        if obj.nbytes > self.max_object_bytes:
            raise ObjectTooLargeError(f"object {key[:200]!r} is {obj.nbytes} bytes; this store takes "
                                      f"at most {self.max_object_bytes} bytes per object")
        payload = _as_bytes_like(contiguous(obj.data))
        k = self.layout.keys(key)
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        with _cluster_errors():
            if ttl is not None and self._redis.exists(k.pinned):
                ttl = None
            px = None if ttl is None else max(1, round(ttl * 1000))
            pipe = self._redis.pipeline(transaction=self.layout.atomic)
            pipe.set(k.data, payload, px=px)
            if obj.checksum:
                pipe.set(k.checksum, obj.checksum, px=px)
            else:  # none: no stale checksum of an earlier object under this key
                pipe.delete(k.checksum)
            if self.layout.atomic:
                pipe.set(k.meta, obj.metadata, px=px)
                pipe.execute()
                return
            pipe.execute()  # across slots: the payload first, so metadata never precedes it
            self._redis.set(k.meta, obj.metadata, px=px)

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with _cluster_errors():
            pipe = self._redis.pipeline(transaction=False)
            for k in map(self.layout.keys, keys):
                for name in (*k.payload, k.pinned, k.leased):
                    pipe.delete(name)
            removed = pipe.execute()
        return sum(1 for i in range(len(keys)) if removed[5 * i] or removed[5 * i + 1])

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> KVObject | None:
        k = self.layout.keys(key)
        with _cluster_errors():
            pipe = self._redis.pipeline(transaction=self.layout.atomic)
            for name in k.payload:
                pipe.get(name)
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
        with _cluster_errors():
            return self._present([self.layout.keys(key) for key in keys], [])

    # -- protection -----------------------------------------------------------------------------

    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        if ttl_s <= 0:
            raise InvalidRequestError(f"lease ttl_s must be positive, got {ttl_s}")
        if not keys:
            return 0
        ms = max(1, round(ttl_s * 1000))
        objects = [self.layout.keys(key) for key in keys]
        with _cluster_errors():
            present = self._present(objects, [("pexpire", ms, {"gt": True})])
            pipe = self._redis.pipeline(transaction=False)
            for k in (k for k, p in zip(objects, present, strict=True) if p):
                pipe.set(k.leased, b"1", px=ms, nx=True)
                pipe.pexpire(k.leased, ms, gt=True)
            pipe.execute()
        return sum(present)

    def release(self, keys: Sequence[str]) -> int:
        return self._drop_markers([self.layout.keys(key).leased for key in keys])

    def pin(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        objects = [self.layout.keys(key) for key in keys]
        with _cluster_errors():
            present = self._present(objects, [("persist", None, {})])
            pipe = self._redis.pipeline(transaction=False)
            for k in (k for k, p in zip(objects, present, strict=True) if p):
                pipe.set(k.pinned, b"1")
            pipe.execute()
        return sum(present)

    def unpin(self, keys: Sequence[str]) -> int:
        objects = [self.layout.keys(key) for key in keys]
        count = self._drop_markers([k.pinned for k in objects])
        if count and self.default_ttl_s is not None:
            # Objects still pinned elsewhere are not touched: only keys with no TTL get one,
            # and only when their marker is gone (checked per object in its own slot).
            ms = max(1, round(self.default_ttl_s * 1000))
            with _cluster_errors():
                pinned = self._markers([k.pinned for k in objects])
                pipe = self._redis.pipeline(transaction=False)
                for k in (k for k, p in zip(objects, pinned, strict=True) if not p):
                    for name in k.payload:
                        pipe.pexpire(name, ms, nx=True)
                pipe.execute()
        return count

    def stats(self) -> BackendStats:
        """Summed over the masters that answer: bytes_used (used_memory), capacity (maxmemory,
        0 = none), evictions (evicted_keys, Redis keys); objects, leased and pinned by SCAN
        (each at most `scan_limit` per master). hits / misses are this front-end's."""
        totals = [0] * 6
        with _cluster_errors():
            for node in self._redis.get_primaries():
                try:
                    for i, n in enumerate(self._node_stats(self._redis.get_redis_connection(node))):
                        totals[i] += n
                except redis.exceptions.RedisError:
                    continue  # a lost master: the others still count
        used, capacity, evicted, objects, leased, pinned = totals
        return BackendStats(objects=objects, bytes_used=used, capacity_bytes=capacity,
                            hits=self._hits, misses=self._misses, evictions=evicted, leased=leased,
                            pinned=pinned)

    def _node_stats(self, node: redis.Redis) -> list[int]:
        info = node.info()
        return [int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)),
                int(info.get("evicted_keys", 0)), self._count(node, self.layout.meta_pattern),
                self._count(node, self.layout.leased_pattern),
                self._count(node, self.layout.pinned_pattern)]

    def probe(self) -> None:
        """Serving while any master answers: one lost master costs its slots (misses), not
        the whole store."""
        with _cluster_errors():
            for node in self._redis.get_primaries():
                try:
                    self._redis.ping(target_nodes=node)
                    return
                except redis.exceptions.RedisError:
                    continue
        raise KVStoreError("no redis cluster master answers")

    def close(self) -> None:
        self._redis.close()

    # -- helpers --------------------------------------------------------------------------------

    def _present(self, objects: list[ObjectKeys], first: list[tuple[str, Any, dict[str, Any]]]
                 ) -> list[bool]:
        """Whether each object's metadata and payload both exist; `first` commands
        (name, argument, options) run on each of its payload keys before the check."""
        pipe = self._redis.pipeline(transaction=False)
        for k in objects:
            for command, arg, kwargs in first:
                for name in k.payload:
                    getattr(pipe, command)(name, *(() if arg is None else (arg,)), **kwargs)
            pipe.exists(k.meta)
            pipe.exists(k.data)
        replies = pipe.execute()
        step = 3 * len(first) + 2
        return [bool(replies[i + step - 2] and replies[i + step - 1])
                for i in range(0, len(replies), step)]

    def _markers(self, names: list[str]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def _drop_markers(self, names: list[str]) -> int:
        if not names:
            return 0
        with _cluster_errors():
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            return sum(1 for n in pipe.execute() if n)

    def _count(self, node: redis.Redis, pattern: str) -> int:
        count = 0
        for _ in node.scan_iter(match=pattern, count=1000):
            count += 1
            if count >= self.scan_limit:
                break
        return count


def parse_cluster_url(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """Startup nodes and connection options of `redis://[user:pw@]h:p[,h:p...][/0]` (each
    item may repeat the scheme: `redis://a:1,redis://b:2`)."""
    nodes: list[ClusterNode] = []
    options: dict[str, Any] = {}
    for item in (part.strip() for part in url.split(",")):
        if not item:
            continue
        parsed = urlsplit(item if "://" in item else "redis://" + item)
        if parsed.scheme not in ("redis", "rediss"):
            raise ValueError(f"redis cluster URL {url!r}: scheme must be redis:// or rediss://")
        if parsed.scheme == "rediss":
            options["ssl"] = True
        if parsed.username:
            options["username"] = unquote(parsed.username)
        if parsed.password:
            options["password"] = unquote(parsed.password)
        if parsed.hostname is None:
            raise ValueError(f"redis cluster URL {url!r}: {item!r} names no host")
        nodes.append(ClusterNode(parsed.hostname, parsed.port or 6379))
    if not nodes:
        raise ValueError(f"redis cluster URL {url!r} names no node")
    return nodes, options


@contextmanager
def _cluster_errors() -> Iterator[None]:
    """redis-py's errors as the store's (OOM -> CapacityError, the rest KVStoreError)."""
    try:
        yield
    except redis.exceptions.ResponseError as exc:
        text = str(exc)
        if "OOM" in text or "maxmemory" in text:
            raise CapacityError(f"redis is out of memory: {text}") from exc
        raise KVStoreError(f"redis cluster error: {text}") from exc
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise KVStoreError(f"redis cluster unavailable: {exc}") from exc
