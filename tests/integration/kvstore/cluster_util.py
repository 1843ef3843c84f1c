"""`pdserve kvstore --backend redis-cluster` front-end processes for the cluster tests, on ports
21500-21999 (helper A's range; the clusters take 21000-21499)."""

from __future__ import annotations

from kvstore.lmcache_format import MemoryFormat, RemoteMetadata
from loadtest.redis_cluster import free_port_in
from tests.integration.services.procs_util import Proc, store_proc

_TAKEN: set[int] = set()


def frontend(cluster_url: str) -> Proc:
    """One front-end over the cluster at `cluster_url`, started (not yet ready)."""
    port = free_port_in(21500, 22000, _TAKEN)
    return store_proc(port, "--backend", "redis-cluster", "--redis-url", cluster_url)


def frontends(cluster_url: str, n: int) -> list[Proc]:
    """`n` ready front-ends (stopped by the caller)."""
    procs = [frontend(cluster_url) for _ in range(n)]
    try:
        return [p.wait_ready() for p in procs]
    except BaseException:
        for p in procs:
            p.stop()
        raise


def location(procs: list[Proc]) -> str:
    """The client location naming every front-end: grpc://a,grpc://b,..."""
    return ",".join(f"grpc://{p.target}" for p in procs)


def lm_key(chunk: int) -> str:
    return f"test-model@1@0@{chunk:x}@bfloat16"


def item(chunk: int, payload: bytes) -> tuple[str, bytes, bytes]:
    """(key, RemoteMetadata of a BINARY payload, payload): what a validating store accepts."""
    return lm_key(chunk), RemoteMetadata.single((len(payload),), "uint8", MemoryFormat.BINARY).pack(), payload
