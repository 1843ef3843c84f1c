"""The redis-cluster backend's "lmcache" layout and LMCache 0.5.6's own `RedisClusterConnector`
(built by its `RedisClusterConnectorAdapter` from a `redis-cluster://` URL) share objects through
a real 3-master Redis Cluster, both ways: LMCache's cluster keys, byte for byte.

The default "slot" layout hash-tags every key (`{K}metadata`), which LMCache's connector does
not do: its objects are not visible to LMCache clients that talk to the cluster directly (they
share objects through a front-end's lm:// port instead); the last test shows that too.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvstore.backend import KVObject
from kvstore.backends import RedisClusterBackend
from kvstore.lmcache_format import MemoryFormat, RemoteMetadata
from tests.integration.kvstore.test_redis_lmcache_compat import (
    DTYPES,
    KV_2LTD,
    LMCACHE_PYTHON,
    kv_chunk,
    lmcache_layout_metadata,
    our_metadata,
    raw_bytes,
    run_peer,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not LMCACHE_PYTHON.exists(),
    reason=f"LMCache venv missing at {LMCACHE_PYTHON}: run `bash kvstore/peers/install_lmcache.sh`")


def lmcache_url(cluster_url: str) -> str:
    return "redis-cluster://" + cluster_url.removeprefix("redis://")


@pytest.mark.slow  # ~20 s (LMCache's import); the default run keeps the other direction
def test_lmcache_cluster_connector_reads_what_our_lmcache_layout_wrote(
        cluster_url: str, tmp_path: Path) -> None:
    key = f"pdserve-compat@1@0@{0x5EED1001:x}@bfloat16"
    chunk = kv_chunk("bfloat16", seed=11)
    store = RedisClusterBackend(cluster_url, layout="lmcache")
    store.put(key, KVObject(metadata=our_metadata(chunk, "bfloat16"), data=raw_bytes(chunk)))
    store.close()

    out = tmp_path / "lmcache_got.bin"
    result = run_peer("get", lmcache_url(cluster_url), key, out, "bfloat16")
    assert result == {"found": True, "shape": list(chunk.shape), "dtype": str(chunk.dtype),
                      "fmt": "KV_2LTD"}
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=chunk.dtype).view(chunk.shape)
    assert torch.equal(got, chunk)


def test_our_lmcache_layout_reads_what_lmcache_cluster_connector_wrote(
        cluster_url: str, tmp_path: Path) -> None:
    code, key_dtype = DTYPES["float32"]
    key = f"pdserve-compat@1@0@{0x5EED1002:x}@{key_dtype}"
    chunk = kv_chunk("float32", seed=12)
    src = tmp_path / "chunk.bin"
    src.write_bytes(raw_bytes(chunk))
    assert run_peer("put", lmcache_url(cluster_url), key, src, "float32")["found"] is True

    store = RedisClusterBackend(cluster_url, layout="lmcache")
    got = store.get(key)
    store.close()
    assert got is not None, "LMCache's object is not visible under its key"
    assert got.metadata == lmcache_layout_metadata(chunk, code)  # byte-identical header
    assert RemoteMetadata.unpack(got.metadata) == RemoteMetadata.single(
        tuple(chunk.shape), "float32", MemoryFormat.KV_2LTD)
    length, fmt, _, *dims = struct.unpack("7i", got.metadata)
    assert (length, fmt) == (len(got.data), KV_2LTD)
    assert torch.equal(torch.frombuffer(bytearray(bytes(got.data)), dtype=chunk.dtype).view(dims), chunk)


@pytest.mark.slow  # ~20 s (LMCache's import); the negative of the two tests above
def test_the_default_slot_layout_is_not_lmcaches(cluster_url: str, tmp_path: Path) -> None:
    key = f"pdserve-compat@1@0@{0x5EED1003:x}@bfloat16"
    chunk = kv_chunk("bfloat16", seed=13)
    store = RedisClusterBackend(cluster_url)
    store.put(key, KVObject(metadata=our_metadata(chunk, "bfloat16"), data=raw_bytes(chunk)))
    store.close()
    assert run_peer("get", lmcache_url(cluster_url), key, tmp_path / "x.bin", "bfloat16") == {"found": False}
