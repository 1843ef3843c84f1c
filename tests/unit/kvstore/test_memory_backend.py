"""MemoryBackend: exact LRU eviction order, protection by leases and pins, capacity accounting,
TTL and lease expiry on a fake clock, and a thread-safety smoke test."""

from __future__ import annotations

import threading

import pytest

from kvstore.backend import CapacityError, InvalidRequestError, KVObject, ObjectTooLargeError
from kvstore.backends import MemoryBackend

META = b"m" * 4  # every test object: 4 metadata bytes + its payload


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def obj(size: int, fill: int = 0) -> KVObject:
    """An object of exactly `size` bytes in all (4 of them metadata)."""
    return KVObject(metadata=META, data=bytes([fill]) * (size - len(META)))


def keys_of(backend: MemoryBackend, keys: list[str]) -> list[str]:
    return [k for k, present in zip(keys, backend.exists(keys), strict=True) if present]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_put_get_round_trip_returns_the_same_object_without_copying() -> None:
    backend = MemoryBackend(capacity_bytes=1000)
    payload = bytearray(b"x" * 96)
    stored = KVObject(metadata=META, data=payload)
    backend.put("a", stored)
    got = backend.get("a")
    assert got is stored and got.data is payload
    assert backend.get("missing") is None
    stats = backend.stats()
    assert (stats.objects, stats.bytes_used, stats.hits, stats.misses) == (1, 100, 1, 1)


def test_evicts_least_recently_used_first_and_get_refreshes_recency() -> None:
    evicted: list[tuple[int, int]] = []
    backend = MemoryBackend(capacity_bytes=300, on_evict=lambda n, b: evicted.append((n, b)))
    for key in ("a", "b", "c"):
        backend.put(key, obj(100))
    backend.get("a")  # order, oldest first: b, c, a
    backend.put("d", obj(100))
    assert keys_of(backend, ["a", "b", "c", "d"]) == ["a", "c", "d"]
    backend.put("e", obj(200))  # needs two: c, then a
    assert keys_of(backend, ["a", "b", "c", "d", "e"]) == ["d", "e"]
    assert evicted == [(1, 100), (2, 200)]
    assert backend.stats().evictions == 3


def test_exists_neither_counts_nor_refreshes_recency() -> None:
    backend = MemoryBackend(capacity_bytes=200)
    backend.put("a", obj(100))
    backend.put("b", obj(100))
    assert backend.exists(["a", "x", "b"]) == [True, False, True]
    backend.put("c", obj(100))  # "a" is still the oldest
    assert keys_of(backend, ["a", "b", "c"]) == ["b", "c"]
    stats = backend.stats()
    assert (stats.hits, stats.misses) == (0, 0)


def test_leased_and_pinned_objects_survive_pressure_and_usage_stays_within_capacity(
        clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=1000, clock=clock)
    for i in range(10):
        backend.put(f"k{i}", obj(100))
    assert backend.lease(["k0", "k1", "k2"], ttl_s=60) == 3
    assert backend.pin(["k3", "k4"]) == 2
    protected = ["k0", "k1", "k2", "k3", "k4"]
    for i in range(40):
        backend.put(f"new{i}", obj(50 + 10 * (i % 6)))
        assert backend.stats().bytes_used <= 1000
        assert backend.exists(protected) == [True] * 5
    stats = backend.stats()
    assert (stats.leased, stats.pinned) == (3, 2)


def test_capacity_error_when_only_protected_objects_remain_evicts_nothing(clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=500, clock=clock)
    for i in range(5):
        backend.put(f"k{i}", obj(100))
    backend.lease(["k0", "k1", "k2"], ttl_s=30)
    backend.pin(["k3"])
    with pytest.raises(CapacityError):
        backend.put("big", obj(250))  # only k4 (100 bytes) is evictable
    assert keys_of(backend, [f"k{i}" for i in range(5)]) == [f"k{i}" for i in range(5)]
    stats = backend.stats()
    assert (stats.objects, stats.bytes_used, stats.evictions) == (5, 500, 0)
    backend.put("fits", obj(100))  # evicting k4 is enough
    assert keys_of(backend, ["k4", "fits"]) == ["fits"]


def test_object_larger_than_max_object_size_or_capacity_is_rejected() -> None:
    backend = MemoryBackend(capacity_bytes=1000, max_object_bytes=200)
    with pytest.raises(ObjectTooLargeError):
        backend.put("a", obj(201))
    backend.put("a", obj(200))
    unbounded = MemoryBackend(capacity_bytes=1000)
    with pytest.raises(ObjectTooLargeError):
        unbounded.put("b", obj(1001))
    assert unbounded.stats().objects == 0


def test_put_replaces_an_existing_key_and_releases_its_old_bytes() -> None:
    backend = MemoryBackend(capacity_bytes=300)
    backend.put("a", obj(100, fill=1))
    backend.put("b", obj(100))
    backend.put("a", obj(250, fill=2))  # frees its own 100, then must evict "b"
    got = backend.get("a")
    assert got is not None and bytes(got.data) == bytes([2]) * 246
    stats = backend.stats()
    assert (stats.objects, stats.bytes_used, stats.evictions) == (1, 250, 1)
    backend.put("a", obj(300))  # replacing with a capacity-sized object needs no eviction
    assert backend.stats().bytes_used == 300


def test_accounting_returns_to_zero_after_deletes() -> None:
    backend = MemoryBackend(capacity_bytes=10_000)
    keys = [f"k{i}" for i in range(20)]
    for i, key in enumerate(keys):
        backend.put(key, obj(10 + i))
    backend.lease(keys[:5], ttl_s=10)
    backend.pin(keys[5:8])
    assert backend.delete([*keys, "never"]) == 20
    stats = backend.stats()
    assert (stats.objects, stats.bytes_used, stats.leased, stats.pinned) == (0, 0, 0, 0)
    assert backend.delete(keys) == 0


def test_ttl_expires_objects_lazily_and_in_the_put_sweep(clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=1000, default_ttl_s=10, clock=clock)
    backend.put("default", obj(100))
    backend.put("short", obj(100), ttl_s=2)
    clock.advance(2)
    assert backend.get("short") is None  # expires exactly at its deadline
    assert backend.get("default") is not None
    clock.advance(8)
    assert backend.exists(["default"]) == [False]
    backend.put("x", obj(100), ttl_s=5)
    clock.advance(6)
    backend.put("y", obj(100))  # the sweep drops "x" without anyone touching it
    stats = backend.stats()
    assert (stats.objects, stats.bytes_used, stats.evictions) == (1, 100, 0)


def test_lease_blocks_eviction_until_its_deadline_and_re_lease_extends_it(clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=200, clock=clock)
    backend.put("a", obj(100))
    backend.put("b", obj(100))
    assert backend.lease(["a", "missing"], ttl_s=5) == 1
    clock.advance(4)
    assert backend.lease(["a"], ttl_s=5) == 1  # now ends at t+9
    clock.advance(4)
    backend.put("c", obj(100))  # "a" is leased: "b" goes
    assert keys_of(backend, ["a", "b", "c"]) == ["a", "c"]
    clock.advance(1.5)  # the lease has ended
    assert backend.stats().leased == 0
    backend.put("d", obj(100))
    assert keys_of(backend, ["a", "c", "d"]) == ["c", "d"]


def test_release_and_unpin_make_objects_evictable_again(clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=200, clock=clock)
    backend.put("a", obj(100))
    backend.put("b", obj(100))
    backend.lease(["a"], ttl_s=60)
    backend.pin(["b"])
    with pytest.raises(CapacityError):
        backend.put("c", obj(100))
    assert backend.release(["a", "b"]) == 1
    assert backend.unpin(["a", "b"]) == 1
    assert backend.release(["a"]) == 0
    backend.put("c", obj(100))
    assert keys_of(backend, ["a", "b", "c"]) == ["b", "c"]


def test_lease_extends_a_shorter_ttl_and_pin_removes_it(clock: FakeClock) -> None:
    backend = MemoryBackend(capacity_bytes=1000, default_ttl_s=5, clock=clock)
    backend.put("leased", obj(100))
    backend.put("pinned", obj(100))
    backend.lease(["leased"], ttl_s=20)
    backend.pin(["pinned"])
    clock.advance(10)
    assert backend.exists(["leased", "pinned"]) == [True, True]
    clock.advance(100)
    assert backend.exists(["leased", "pinned"]) == [False, True]
    backend.unpin(["pinned"])  # the default TTL restarts from the unpin
    clock.advance(4)
    assert backend.exists(["pinned"]) == [True]
    clock.advance(1)
    assert backend.exists(["pinned"]) == [False]


def test_invalid_arguments_are_rejected() -> None:
    backend = MemoryBackend(capacity_bytes=100)
    with pytest.raises(InvalidRequestError):
        backend.put("", obj(10))
    with pytest.raises(InvalidRequestError):
        backend.put("a", obj(10), ttl_s=0)
    with pytest.raises(InvalidRequestError):
        backend.lease(["a"], ttl_s=-1)
    with pytest.raises(ValueError):
        MemoryBackend(capacity_bytes=0)


def test_longest_prefix_counts_present_keys_from_the_first() -> None:
    backend = MemoryBackend(capacity_bytes=1000)
    for key in ("h0", "h1", "h3"):
        backend.put(key, obj(10))
    assert backend.longest_prefix(["h0", "h1", "h2", "h3"]) == 2
    assert backend.longest_prefix(["x", "h0"]) == 0
    assert backend.longest_prefix([]) == 0


def test_concurrent_puts_gets_and_leases_keep_accounting_consistent() -> None:
    backend = MemoryBackend(capacity_bytes=5_000)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(300):
                key = f"t{tid}-{i % 40}"
                backend.put(key, obj(50 + (i % 7) * 10, fill=tid))
                got = backend.get(key)
                assert got is None or bytes(got.data[:1]) == bytes([tid])
                if i % 10 == 0:
                    backend.lease([key], ttl_s=0.01)
                if i % 17 == 0:
                    backend.delete([f"t{tid}-{(i + 3) % 40}"])
                assert backend.stats().bytes_used <= 5_000
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    stats = backend.stats()
    total = 0
    for t in range(4):
        for i in range(40):
            got = backend.get(f"t{t}-{i}")
            total += got.nbytes if got is not None else 0
    assert stats.bytes_used == total <= 5_000
