"""Several `pdserve kvstore --backend redis-cluster` processes over one Redis Cluster are
stateless front-ends of one store: what one stores the others serve, a pin or a lease taken
through one is seen through the others, and a client given all of them (a comma-separated list,
or `dns:name:port`) spreads its calls over them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.client import KVStoreClient
from tests.integration.kvstore.cluster_util import frontends, item, lm_key, location
from tests.integration.services.procs_util import Proc


@pytest.fixture(scope="module")
def fronts(redis_cluster: object) -> Iterator[list[Proc]]:
    from loadtest.redis_cluster import RedisCluster

    assert isinstance(redis_cluster, RedisCluster)
    procs = frontends(redis_cluster.url, 3)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def client_of(proc: Proc) -> KVStoreClient:
    return KVStoreClient(f"grpc://{proc.target}", timeout_s=10, use_shm=False)


def test_objects_put_through_one_front_end_are_read_through_the_others(
        fronts: list[Proc], cluster_url: str) -> None:
    one, two, three = (client_of(p) for p in fronts)
    try:
        items = [item(i, bytes([i]) * (4096 + i)) for i in range(12)]
        one.put(items)
        for reader in (two, three):
            got = reader.get([k for k, _, _ in items])
            assert [(o.metadata, bytes(o.data)) for o in got if o is not None] == \
                [(m, d) for _, m, d in items]
            assert reader.lookup([lm_key(0), lm_key(1), lm_key(99)]) == 2
        assert three.delete([lm_key(0)]) == 1
        assert two.get([lm_key(0)]) == [None]
        assert {c.stats().backend for c in (one, two, three)} == {"redis-cluster"}
    finally:
        for c in (one, two, three):
            c.close()


def test_pins_and_leases_taken_through_one_front_end_hold_through_the_others(
        fronts: list[Proc], cluster_url: str) -> None:
    one, two, three = (client_of(p) for p in fronts)
    try:
        one.put([item(i, b"d") for i in range(4)])
        assert one.pin([lm_key(0), lm_key(1)]) == 2
        assert one.lease([lm_key(2), lm_key(3)], 600) == 2
        assert (two.stats().pinned, two.stats().leased) == (2, 2)
        assert three.unpin([lm_key(0)]) == 1 and three.release([lm_key(2)]) == 1
        assert two.unpin([lm_key(0)]) == 0  # already unpinned elsewhere
        assert (one.stats().pinned, one.stats().leased) == (1, 1)
    finally:
        for c in (one, two, three):
            c.close()


def test_a_client_of_all_front_ends_spreads_its_calls_over_them(
        fronts: list[Proc], cluster_url: str) -> None:
    before = [client_of(p).stats().hits for p in fronts]
    with KVStoreClient(location(fronts), timeout_s=10, use_shm=False) as client:
        client.put([item(i, b"d") for i in range(60)])
        for i in range(60):
            got = client.get([lm_key(i)])[0]
            assert got is not None and bytes(got.data) == b"d"
    served = [client_of(p).stats().hits - b for p, b in zip(fronts, before, strict=True)]
    assert sum(served) == 60 and all(n >= 5 for n in served), served


def test_a_dns_location_reaches_the_front_ends_its_name_resolves_to(
        fronts: list[Proc], cluster_url: str) -> None:
    port = fronts[0].target.rsplit(":", 1)[1]
    with KVStoreClient(f"dns:localhost:{port}", timeout_s=10, use_shm=False) as client:
        client.put([item(1, b"via-dns")])
        got = client.get([lm_key(1)])[0]
        assert got is not None and bytes(got.data) == b"via-dns"
