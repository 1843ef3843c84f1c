"""Faults under a bounded concurrent load (4 client threads, a fixed number of operations, a
deadline) on a store of front-ends over a Redis Cluster:
- a front-end killed (SIGKILL): the client moves every call on to the others; no call fails and
  every get finds its object (the data lives in the cluster, not in the front-end);
- a Redis master killed (SIGKILL): calls on its slots fail fast with KVStoreClientError (what
  the KV connector takes as a miss or a dropped put), calls on the other masters' slots go on
  serving, and the front-ends stay SERVING. The request-level proof (workers recompute, every
  request succeeds with the same output) is tests/integration/services/faults/test_store_cluster_faults.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.cluster import RedisCluster as RedisPyCluster

from kvstore.backends.cluster_keys import KeyLayout
from kvstore.client import KVStoreClient, KVStoreClientError
from loadtest.redis_cluster import RedisCluster, missing_tools
from tests.integration.kvstore.cluster_util import frontends, item, location

THREADS, OPS, DEADLINE_S = 4, 40, 90.0


def run_load(op: Callable[[int, int], None], strike: Callable[[], None]) -> list[BaseException]:
    """THREADS threads run op(thread, i) for i < OPS; `strike()` runs once a quarter of all
    operations are done. Returns every exception the operations raised."""
    done = threading.Semaphore(0)
    errors: list[BaseException] = []
    stop_at = time.monotonic() + DEADLINE_S

    def worker(t: int) -> None:
        for i in range(OPS):
            if time.monotonic() > stop_at:
                errors.append(TimeoutError(f"thread {t} ran out of time at op {i}"))
                return
            try:
                op(t, i)
            except BaseException as exc:  # every failure is the test's result
                errors.append(exc)
            done.release()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for _ in range(THREADS * OPS // 4):
        assert done.acquire(timeout=DEADLINE_S), "the load stalled before the fault"
    strike()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads)
    return errors


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test's own (a master of it gets killed)."""
    why = missing_tools()
    if why is not None:
        pytest.skip(why)
    with RedisCluster(tmp_path, low=21000, high=21500) as cluster:
        yield cluster


@pytest.mark.slow  # ~10 s; the default run has the request-level twin in test_store_cluster_faults.py
def test_a_front_end_killed_under_load_fails_no_call(redis_cluster: RedisCluster) -> None:
    fronts = frontends(redis_cluster.url, 3)
    client = KVStoreClient(location(fronts), timeout_s=5, use_shm=False)
    misses: list[str] = []

    def op(t: int, i: int) -> None:
        key, meta, payload = item(1000 * t + i, bytes([i]) * 20_000)
        client.put([(key, meta, payload)])
        got = client.get([key])[0]
        if got is None or bytes(got.data) != payload:
            misses.append(key)

    try:
        errors = run_load(op, strike=lambda: fronts[1].signal(9))
        assert errors == [] and misses == []
        assert fronts[1].proc.wait(timeout=10) == -9
    finally:
        client.close()
        for p in fronts:
            p.stop()


def test_a_master_killed_under_load_costs_only_its_slots(own_cluster: RedisCluster) -> None:
    fronts = frontends(own_cluster.url, 2)
    client = KVStoreClient(location(fronts), timeout_s=5, use_shm=False)
    keys = [item(i, bytes([i % 251]) * 20_000) for i in range(80)]
    client.put(keys)
    raw = RedisPyCluster(host="127.0.0.1", port=own_cluster.ports[1])
    victim = f"127.0.0.1:{own_cluster.ports[0]}"
    on_victim = {k for k, _, _ in keys if raw.get_node_from_key(KeyLayout().keys(k).meta).name == victim}
    raw.close()
    assert 0 < len(on_victim) < len(keys)
    killed = threading.Event()
    wrong: list[str] = []
    lost_elsewhere: list[str] = []
    slowest = [0.0]

    def strike() -> None:
        own_cluster.kill(0)
        killed.set()

    def op(t: int, i: int) -> None:
        key, _, payload = keys[(t * OPS + i) % len(keys)]
        start = time.monotonic()
        try:
            got = client.get([key])[0]
        except KVStoreClientError:  # the connector's miss
            if not killed.is_set() or key not in on_victim:
                lost_elsewhere.append(key)
            return
        finally:
            slowest[0] = max(slowest[0], time.monotonic() - start)
        if got is None or bytes(got.data) != payload:
            wrong.append(key)

    try:
        errors = run_load(op, strike)
        assert errors == [] and wrong == []
        assert lost_elsewhere == []  # every failure is a key of the killed master's slots
        assert slowest[0] < 5.0  # fails fast, never waits out the client timeout
        survivors = [k for k in keys if k[0] not in on_victim]
        assert all(o is not None for o in client.get([k for k, _, _ in survivors]))
        for p in fronts:
            with KVStoreClient(f"grpc://{p.target}", timeout_s=5, use_shm=False) as one:
                assert one.health() == "SERVING"
        with pytest.raises(KVStoreClientError):
            client.get([next(iter(on_victim))])
    finally:
        client.close()
        for p in fronts:
            p.stop()


