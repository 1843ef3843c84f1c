"""Checksums (kvstore/integrity.py) through a real store: kept and returned as given over
Flight (whole objects and parallel parts), the shared-memory path and the Redis backend (in a
key of its own beside LMCache's two, which stay byte for byte LMCache's); lm:// puts carry none
and lm:// gets answer only LMCache's bytes; an over-long checksum is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from kvstore import integrity
from kvstore.client import KVStoreClient, KVStoreRejectedError
from kvstore.lm_client import LMClient
from kvstore.lmcache_format import CacheEngineKey, MemoryFormat, RemoteMetadata, tensor_to_buffer
from kvstore.service import KVStoreService, StoreOptions

CHUNK = CacheEngineKey("tiny", 1, 0, 0xC0FFEE, "float32")
SECRET = integrity.derive_key("test integrity key")


def signed(layer: int, tensor: torch.Tensor) -> tuple[str, bytes, object, bytes]:
    key = CHUNK.layer(layer).to_string()
    meta = RemoteMetadata.single(tuple(tensor.shape), tensor.dtype, MemoryFormat.KV_T2D).pack()
    payload = tensor_to_buffer(tensor)
    return key, meta, payload, integrity.checksum(key, meta, payload, SECRET)


@pytest.fixture(params=["flight", "shm", "flight-parts", "redis"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStoreClient]:
    if request.param == "redis":
        opts = StoreOptions(backend="redis", redis_url=request.getfixturevalue("redis_url"), port=0,
                            shm_dir="off")
    else:
        opts = StoreOptions(capacity="64MiB", port=0,
                            shm_dir=str(tmp_path) if request.param == "shm" else "off")
    split = 4096 if request.param == "flight-parts" else 16 * 2**20
    with KVStoreService(opts) as service, \
         KVStoreClient(service.location, streams=3, split_put_bytes=split) as c:
        if request.param == "shm":
            assert c.shm_dir() is not None
        yield c


def test_checksums_round_trip(client: KVStoreClient) -> None:
    items = [signed(layer, torch.randn(64, 2, 32)) for layer in range(3)]
    unsigned = (CHUNK.layer(9).to_string(), *items[0][1:3])
    client.put([*items, unsigned])
    keys = [it[0] for it in items]
    got = client.get([*keys, unsigned[0], CHUNK.layer(7).to_string()])
    for (key, _, _, digest), obj in zip(items, got, strict=False):
        assert obj is not None and obj.checksum == digest
        assert integrity.verify(key, obj.metadata, obj.data, obj.checksum, SECRET)
    assert got[3] is not None and got[3].checksum == b""
    assert got[4] is None
    streamed = [(i, o.checksum) for i, o in client.get_stream(keys, batch=2) if o is not None]
    assert streamed == [(i, it[3]) for i, it in enumerate(items)]
    outs = [np.empty(64 * 2 * 32 * 4, dtype=np.uint8) for _ in keys]
    sums: list[bytes] = []
    client.get_into(keys, outs, checksums=sums)
    assert sums == [it[3] for it in items]
    # a copy under another key keeps its checksum, which no longer verifies there
    key, meta, payload, digest = items[0]
    moved = CHUNK.layer(5).to_string()
    client.put([(moved, meta, payload, digest)])
    obj = client.get([moved])[0]
    assert obj is not None and not integrity.verify(moved, obj.metadata, obj.data, obj.checksum, SECRET)


def test_over_long_checksum_is_refused(client: KVStoreClient) -> None:
    key, meta, payload, _ = signed(0, torch.randn(64, 2, 32))
    with pytest.raises(KVStoreRejectedError, match="checksum of 65 bytes, at most 64"):
        client.put([(key, meta, payload, b"x" * 65)])
    assert client.get([key]) == [None]


def test_redis_keeps_lmcache_keys_and_a_third_for_the_checksum(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    key, meta, payload, digest = signed(0, torch.randn(16, 2, 8))
    with KVStoreService(StoreOptions(backend="redis", redis_url=redis_url, port=0)) as service, \
         KVStoreClient(service.location, use_shm=False) as c:
        c.put([(key, meta, payload, digest)])
        assert raw.get(key + "metadata") == meta
        assert raw.get(key + "kv_bytes") == bytes(memoryview(payload))  # type: ignore[arg-type]
        assert raw.get(key + "checksum") == digest
        c.put([(key, meta, payload)])  # replaced without a checksum: none left behind
        assert raw.get(key + "checksum") is None
        c.put([(key, meta, payload, digest)])
        assert c.lease([key], 30) == 1 and c.pin([key]) == 1
        assert raw.ttl(key + "checksum") == -1
        assert c.delete([key]) == 1
        assert raw.keys("*" + "checksum") == []
    raw.close()


def test_lm_puts_carry_no_checksum_and_lm_gets_return_lmcache_bytes() -> None:
    opts = StoreOptions(capacity="64MiB", port=0, lm_port=0, shm_dir="off")
    tensor = torch.randn(16, 2, 8)
    key, meta, payload, digest = signed(0, tensor)
    with KVStoreService(opts) as service, KVStoreClient(service.location) as c, \
         LMClient("127.0.0.1", service.lm_server.port, timeout_s=10) as lm:
        c.put([(key, meta, payload, digest)])
        got = lm.get(key)
        assert got is not None and bytes(got[1]) == tensor.numpy().tobytes()
        assert got[0].pack() == meta
        other = CHUNK.layer(1).to_string()
        lm.put(other, tensor.numpy().tobytes(), RemoteMetadata.unpack(meta))
        assert lm.exists(other)  # served in order: the put is done
        obj = c.get([other])[0]
        assert obj is not None and obj.checksum == b"" and obj.metadata == meta
