"""RedisBackend against a real redis-server: LMCache's key layout, atomic visibility under a
concurrent writer, TTLs, leases, pins, deletes, prefix lookups, stats and Redis' OOM errors."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvstore.backend import CapacityError, InvalidRequestError, KVObject, KVStoreError
from kvstore.backends import RedisBackend


def lm_key(chunk: int) -> str:
    return f"test-model@1@0@{chunk:x}@bfloat16"


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    store = RedisBackend(redis_url, socket_timeout_s=10)
    yield store
    store.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_put_writes_lmcache_layout_and_get_round_trips(backend: RedisBackend, raw: redis.Redis) -> None:
    key = lm_key(0xABC)
    payload = bytes(range(256)) * 64
    backend.put(key, KVObject(metadata=b"meta-bytes", data=memoryview(bytearray(payload))))
    assert raw.get(key + "metadata") == b"meta-bytes"
    assert raw.get(key + "kv_bytes") == payload
    assert sorted(raw.keys("*")) == sorted([(key + "metadata").encode(), (key + "kv_bytes").encode()])
    got = backend.get(key)
    assert got is not None and got.metadata == b"meta-bytes" and bytes(got.data) == payload
    assert backend.get(lm_key(1)) is None
    stats = backend.stats()
    assert (stats.objects, stats.hits, stats.misses) == (1, 1, 1)


def test_half_written_object_is_a_miss(backend: RedisBackend, raw: redis.Redis) -> None:
    raw.set(lm_key(1) + "metadata", b"m")  # as a crashed LMCache writer could leave it
    raw.set(lm_key(2) + "kv_bytes", b"d")
    assert backend.get(lm_key(1)) is None and backend.get(lm_key(2)) is None
    assert backend.exists([lm_key(1), lm_key(2)]) == [False, False]


def test_reader_never_sees_a_partial_object_while_a_writer_replaces_it(redis_url: str) -> None:
    key, size, versions = lm_key(7), 2 * 1024 * 1024, 40
    writer_store, reader_store = RedisBackend(redis_url), RedisBackend(redis_url)
    done = threading.Event()
    seen: set[int] = set()
    bad: list[str] = []

    def write() -> None:
        try:
            for version in range(1, versions + 1):
                data = bytes([version]) * (size + version)  # length and contents both change
                writer_store.put(key, KVObject(metadata=struct.pack("<ii", version, len(data)), data=data))
        finally:
            done.set()

    def read() -> None:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            got = reader_store.get(key)
            if got is None:
                continue
            version, length = struct.unpack("<ii", got.metadata)
            data = bytes(got.data)
            if len(data) != length or data[:1] != bytes([version]) or data[-1:] != bytes([version]):
                bad.append(f"metadata v{version}/{length} with payload v{data[0]}/{len(data)}")
            seen.add(version)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    writer_store.close()
    reader_store.close()
    assert not bad, bad[:5]
    assert len(seen) >= 2, "the reader never overlapped the writer"


def test_ttl_applies_to_both_keys_and_expires_the_object(redis_url: str, raw: redis.Redis) -> None:
    store = RedisBackend(redis_url, default_ttl_s=30)
    store.put(lm_key(1), KVObject(b"m", b"d"))
    store.put(lm_key(2), KVObject(b"m", b"d"), ttl_s=0.3)
    assert 0 < raw.pttl(lm_key(1) + "metadata") <= 30_000
    assert 0 < raw.pttl(lm_key(1) + "kv_bytes") <= 30_000
    assert 0 < raw.pttl(lm_key(2) + "kv_bytes") <= 300
    time.sleep(0.5)
    assert store.exists([lm_key(1), lm_key(2)]) == [True, False]
    assert store.get(lm_key(2)) is None
    store.close()


def test_lease_extends_a_ttl_and_release_ends_the_lease(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.put(lm_key(1), KVObject(b"m", b"d"), ttl_s=1)
    backend.put(lm_key(2), KVObject(b"m", b"d"))  # no TTL: a lease adds none
    assert backend.lease([lm_key(1), lm_key(2), lm_key(3)], ttl_s=60) == 2
    assert raw.pttl(lm_key(1) + "metadata") > 50_000 and raw.pttl(lm_key(1) + "kv_bytes") > 50_000
    assert raw.pttl(lm_key(2) + "metadata") == -1
    assert backend.lease([lm_key(1)], ttl_s=5) == 1  # a shorter lease does not shorten the TTL
    assert raw.pttl(lm_key(1) + "metadata") > 50_000
    assert backend.stats().leased == 2
    assert backend.release([lm_key(1), lm_key(3)]) == 1
    assert backend.stats().leased == 1


def test_pin_removes_the_ttl_until_unpin_restores_the_default(redis_url: str, raw: redis.Redis) -> None:
    store = RedisBackend(redis_url, default_ttl_s=20)
    store.put(lm_key(1), KVObject(b"m", b"d"))
    assert store.pin([lm_key(1), lm_key(9)]) == 1
    assert raw.pttl(lm_key(1) + "metadata") == -1 and raw.pttl(lm_key(1) + "kv_bytes") == -1
    assert raw.smembers("pdserve:pinned") == {lm_key(1).encode()}
    store.put(lm_key(1), KVObject(b"m2", b"d2"), ttl_s=1)  # a pinned key keeps no TTL
    assert raw.pttl(lm_key(1) + "kv_bytes") == -1
    assert store.stats().pinned == 1
    assert store.unpin([lm_key(1), lm_key(9)]) == 1
    assert 0 < raw.pttl(lm_key(1) + "metadata") <= 20_000
    assert store.stats().pinned == 0
    store.close()


def test_delete_removes_both_keys_and_protection(backend: RedisBackend, raw: redis.Redis) -> None:
    for chunk in range(3):
        backend.put(lm_key(chunk), KVObject(b"m", b"d"))
    backend.pin([lm_key(0)])
    backend.lease([lm_key(1)], ttl_s=30)
    assert backend.delete([lm_key(0), lm_key(1), lm_key(5)]) == 2
    assert backend.exists([lm_key(0), lm_key(1), lm_key(2)]) == [False, False, True]
    assert raw.exists(lm_key(0) + "metadata", lm_key(0) + "kv_bytes") == 0
    stats = backend.stats()
    assert (stats.objects, stats.pinned, stats.leased) == (1, 0, 0)


def test_exists_and_longest_prefix(backend: RedisBackend) -> None:
    for chunk in (0, 1, 2, 4):
        backend.put(lm_key(chunk), KVObject(b"m", b"d"))
    chain = [lm_key(c) for c in range(6)]
    assert backend.exists(chain) == [True, True, True, False, True, False]
    assert backend.longest_prefix(chain) == 3
    assert backend.longest_prefix([]) == 0
    assert backend.stats().hits == 0


def test_stats_report_server_memory_and_maxmemory(backend: RedisBackend, raw: redis.Redis) -> None:
    raw.config_set("maxmemory", 256 * 1024 * 1024)
    backend.put(lm_key(1), KVObject(b"m", b"x" * 100_000))
    stats = backend.stats()
    assert stats.capacity_bytes == 256 * 1024 * 1024
    assert stats.bytes_used >= 100_000 and stats.objects == 1


def test_out_of_memory_raises_capacity_error_and_leaves_no_half_object(
        backend: RedisBackend, raw: redis.Redis) -> None:
    used = int(raw.info("memory")["used_memory"])
    raw.config_set("maxmemory", used + 3 * 1024 * 1024)
    raw.config_set("maxmemory-policy", "noeviction")
    failed = None
    for chunk in range(20):
        try:
            backend.put(lm_key(chunk), KVObject(b"m", b"x" * 1024 * 1024))
        except CapacityError:
            failed = chunk
            break
    assert failed is not None, "redis never refused a write"
    assert raw.exists(lm_key(failed) + "metadata", lm_key(failed) + "kv_bytes") == 0


def test_empty_key_and_bad_ttl_are_rejected(backend: RedisBackend) -> None:
    with pytest.raises(InvalidRequestError):
        backend.put("", KVObject(b"m", b"d"))
    with pytest.raises(InvalidRequestError):
        backend.lease([lm_key(1)], ttl_s=0)


def test_password_from_a_file_never_in_the_url(redis_url: str, raw: redis.Redis, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis with requirepass (compose runs one): the backend authenticates with the password
    from $PDSERVE_REDIS_PASSWORD_FILE; without it every call is refused."""
    raw.config_set("requirepass", "s3cret-pw")
    try:
        with pytest.raises(KVStoreError, match="authenticated"):
            RedisBackend(redis_url).exists(["k"])
        (tmp_path / "pw").write_text("s3cret-pw\n")
        monkeypatch.setenv("PDSERVE_REDIS_PASSWORD_FILE", str(tmp_path / "pw"))
        backend = RedisBackend(redis_url)
        backend.put(lm_key(0), KVObject(b"m", b"payload"))
        assert backend.exists([lm_key(0)]) == [True]
        backend.close()
    finally:
        authed = redis.Redis.from_url(redis_url, password="s3cret-pw")
        authed.config_set("requirepass", "")
        authed.close()
