"""RedisClusterBackend on a real 3-master Redis Cluster: the backend contract (put, get, exists,
delete, lease, release, pin, unpin, stats), an object's keys in one hash slot on one master,
atomic visibility under a concurrent writer, protection that a second front-end (a second
backend instance) sees, and the "lmcache" layout's keys."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster as RedisPyCluster

from kvstore.backend import InvalidRequestError, KVObject
from kvstore.backends import RedisClusterBackend
from kvstore.backends.cluster_keys import KeyLayout


def lm_key(chunk: int) -> str:
    return f"test-model@1@0@{chunk:x}@bfloat16"


@pytest.fixture
def backend(cluster_url: str) -> Iterator[RedisClusterBackend]:
    store = RedisClusterBackend(cluster_url)
    yield store
    store.close()


@pytest.fixture
def raw(cluster_url: str) -> Iterator[RedisPyCluster]:
    host, port = cluster_url.removeprefix("redis://").split(",")[0].split(":")
    client = RedisPyCluster(host=host, port=int(port))
    yield client
    client.close()


def test_put_get_exists_delete_round_trip_with_checksums(backend: RedisClusterBackend) -> None:
    payload = bytes(range(256)) * 64
    backend.put(lm_key(1), KVObject(b"meta", memoryview(bytearray(payload)), b"sum"))
    got = backend.get(lm_key(1))
    assert got is not None and (got.metadata, bytes(got.data), got.checksum) == (b"meta", payload, b"sum")
    backend.put(lm_key(1), KVObject(b"meta2", b"x"))  # replaced without a checksum: none stays
    got = backend.get(lm_key(1))
    assert got is not None and (got.metadata, bytes(got.data), got.checksum) == (b"meta2", b"x", b"")
    assert backend.get(lm_key(2)) is None
    assert backend.exists([lm_key(1), lm_key(2)]) == [True, False]
    assert backend.longest_prefix([lm_key(1), lm_key(2), lm_key(1)]) == 1
    assert backend.delete([lm_key(1), lm_key(2)]) == 1
    assert backend.get(lm_key(1)) is None
    stats = backend.stats()
    assert (stats.objects, stats.hits, stats.misses) == (0, 2, 2)
    with pytest.raises(InvalidRequestError):
        backend.put("", KVObject(b"m", b"d"))


@pytest.mark.parametrize("key", [lm_key(0xABC), "model@1@0@{odd}@half", "}leading-brace", "a{b}c}"])
def test_every_key_of_an_object_lives_in_one_slot_on_one_master(
        backend: RedisClusterBackend, raw: RedisPyCluster, key: str) -> None:
    backend.put(key, KVObject(b"m", b"payload", b"c"))
    backend.pin([key])
    backend.lease([key], 60)
    names = KeyLayout("slot").keys(key)
    stored = [n for n in (*names.payload, names.pinned, names.leased) if raw.exists(n)]
    assert len(stored) == 5
    assert len({raw.keyslot(n) for n in stored}) == 1
    assert len({raw.get_node_from_key(n).name for n in stored}) == 1
    assert backend.get(key) == KVObject(b"m", b"payload", b"c")


def test_objects_spread_over_all_masters(backend: RedisClusterBackend, raw: RedisPyCluster) -> None:
    keys = [lm_key(i) for i in range(60)]
    for key in keys:
        backend.put(key, KVObject(b"m", b"d"))
    nodes = {raw.get_node_from_key(KeyLayout("slot").keys(k).meta).name for k in keys}
    assert len(nodes) == 3
    assert backend.stats().objects == 60


def test_reader_never_sees_a_partial_object_while_a_writer_replaces_it(cluster_url: str) -> None:
    key, size, versions = lm_key(7), 512 * 1024, 40
    writer, reader = RedisClusterBackend(cluster_url), RedisClusterBackend(cluster_url)
    done = threading.Event()
    seen: list[tuple[bytes, bytes]] = []

    def write() -> None:
        for v in range(versions):
            writer.put(key, KVObject(f"v{v}".encode(), bytes([v]) * size, f"c{v}".encode()))
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        while not done.is_set():
            got = reader.get(key)
            if got is not None:
                data = bytes(got.data)
                assert data == data[:1] * size, "payload mixes two versions"
                assert got.metadata == f"v{data[0]}".encode() and got.checksum == f"c{data[0]}".encode()
                seen.append((got.metadata, got.checksum))
    finally:
        thread.join(timeout=60)
        writer.close()
        reader.close()
    assert len({m for m, _ in seen}) >= 2  # the reader saw several versions, each whole


def test_pins_and_leases_are_seen_by_a_second_front_end(cluster_url: str, raw: RedisPyCluster) -> None:
    one = RedisClusterBackend(cluster_url, default_ttl_s=30)
    two = RedisClusterBackend(cluster_url, default_ttl_s=30)
    try:
        for i in range(6):
            one.put(lm_key(i), KVObject(b"m", b"d"))
        assert one.pin([lm_key(0), lm_key(1), lm_key(99)]) == 2
        assert one.lease([lm_key(2), lm_key(3), lm_key(98)], 600) == 2
        stats = two.stats()
        assert (stats.pinned, stats.leased, stats.objects) == (2, 2, 6)
        names = KeyLayout("slot").keys(lm_key(0))
        assert raw.ttl(names.data) == -1  # pinned: no expiry
        assert 500 < raw.ttl(KeyLayout("slot").keys(lm_key(2)).data) <= 600  # leased past the TTL
        two.put(lm_key(0), KVObject(b"m2", b"d2"))  # a pinned object replaced elsewhere stays pinned
        assert raw.ttl(names.data) == -1
        assert two.unpin([lm_key(0), lm_key(5)]) == 1
        assert 0 < raw.ttl(names.data) <= 30  # back to the default TTL
        assert two.release([lm_key(2), lm_key(4)]) == 1
        assert one.delete([lm_key(1), lm_key(3)]) == 2  # markers go with the object
        stats = one.stats()
        assert (stats.pinned, stats.leased) == (0, 0)
    finally:
        one.close()
        two.close()


def test_a_lease_ends_at_its_deadline(backend: RedisClusterBackend) -> None:
    backend.put(lm_key(1), KVObject(b"m", b"d"))
    assert backend.lease([lm_key(1)], 0.3) == 1
    assert backend.stats().leased == 1
    time.sleep(0.5)
    assert backend.stats().leased == 0
    assert backend.release([lm_key(1)]) == 0
    with pytest.raises(InvalidRequestError):
        backend.lease([lm_key(1)], 0)


def test_lmcache_layout_uses_lmcache_cluster_keys(cluster_url: str, raw: RedisPyCluster) -> None:
    store = RedisClusterBackend(cluster_url, layout="lmcache")
    try:
        store.put(lm_key(5), KVObject(b"meta", b"kv", b"sum"))
        assert raw.get(lm_key(5) + "metadata") == b"meta"
        assert raw.get(lm_key(5) + "kv_bytes") == b"kv"
        assert store.get(lm_key(5)) == KVObject(b"meta", b"kv", b"sum")
        raw.delete(lm_key(5) + "kv_bytes")  # as Redis could evict one of the two: a miss
        assert store.get(lm_key(5)) is None and store.exists([lm_key(5)]) == [False]
    finally:
        store.close()


def test_a_url_with_one_startup_node_finds_the_whole_cluster(cluster_url: str) -> None:
    first = cluster_url.split(",")[0]
    store = RedisClusterBackend(first)
    try:
        for i in range(30):
            store.put(lm_key(i), KVObject(b"m", b"d"))
        assert store.stats().objects == 30
    finally:
        store.close()
    with pytest.raises(ValueError, match="scheme"):
        RedisClusterBackend("http://127.0.0.1:1")
