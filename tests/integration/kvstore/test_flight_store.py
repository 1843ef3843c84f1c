"""The KV store server and client over real Arrow Flight on loopback: round trips (zero-copy
tensor payloads), lookups, control actions, metrics, and bad input: every error is clear, the
server keeps serving, no partial object is ever readable, accounting returns to zero. Tests
through the `client` fixture run twice: over Flight, and with payloads through the server's
shared-memory directory (kvstore/shm.py; its own cases are in test_shm_path.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.backend import KVObject
from kvstore.backends.memory import MemoryBackend
from kvstore.client import KVStoreClient, KVStoreClientError
from kvstore.lmcache_format import (
    CacheEngineKey,
    MemoryFormat,
    RemoteMetadata,
    buffer_to_tensor,
    tensor_to_buffer,
)
from kvstore.service import KVStoreService, StoreOptions

ROOT = Path(__file__).resolve().parents[3]
CHUNK = CacheEngineKey("smollm2-135m-instruct", 1, 0, 0x1234ABCD, "float32")


def item(layer: int, tensor: torch.Tensor, chunk: CacheEngineKey = CHUNK) -> tuple[str, bytes, object]:
    meta = RemoteMetadata.single(tuple(tensor.shape), tensor.dtype, MemoryFormat.KV_T2D).pack()
    return chunk.layer(layer).to_string(), meta, tensor_to_buffer(tensor)


@pytest.fixture
def store() -> Iterator[KVStoreService]:
    opts = StoreOptions(capacity="64MiB", max_object_size="16MiB", port=0)
    with KVStoreService(opts) as service:
        yield service


@pytest.fixture(params=["flight", "shm"])
def client(store: KVStoreService, request: pytest.FixtureRequest) -> Iterator[KVStoreClient]:
    with KVStoreClient(store.location, timeout_s=20, use_shm=request.param == "shm") as c:
        assert (c.shm_dir() is not None) == (request.param == "shm")
        yield c


@pytest.fixture
def flight_client(store: KVStoreService) -> Iterator[KVStoreClient]:
    with KVStoreClient(store.location, timeout_s=20, use_shm=False) as c:
        yield c


def test_layers_round_trip_bit_exact_and_into_preallocated_tensors(client: KVStoreClient) -> None:
    layers = [torch.randn(256, 2, 192) for _ in range(4)] + [torch.randn(16, 2, 8).bfloat16()]
    client.put([item(i, t) for i, t in enumerate(layers)])
    keys = [CHUNK.layer(i).to_string() for i in range(len(layers))]
    got = client.get(keys)
    for obj, want in zip(got, layers, strict=True):
        assert obj is not None
        meta = RemoteMetadata.unpack(obj.metadata)
        assert meta.length == len(obj.data) == want.numel() * want.element_size()
        back = buffer_to_tensor(obj.data, want.dtype, want.shape)
        assert torch.equal(back, want)
    outs = [torch.empty_like(t) for t in layers]
    metas = client.get_into(keys, [o.view(torch.uint8).numpy() for o in outs])
    assert all(m is not None for m in metas)
    assert all(torch.equal(o, t) for o, t in zip(outs, layers, strict=True))


def test_lookup_gives_the_longest_present_prefix(client: KVStoreClient) -> None:
    chunks = [CacheEngineKey("m", 1, 0, h, "float32") for h in range(1, 6)]
    t = torch.ones(4, 2, 8)
    client.put([item(0, t, c) for c in chunks[:3]] + [item(0, t, chunks[4])])
    keys = [c.layer(0).to_string() for c in chunks]
    assert client.lookup(keys) == 3
    assert client.exists(keys) == [True, True, True, False, True]
    assert client.lookup([]) == 0
    assert client.get([keys[3]]) == [None]


def test_accounting_returns_to_zero_after_deletes(client: KVStoreClient) -> None:
    items = [item(i, torch.randn(64, 2, 32)) for i in range(10)]
    client.put(items)
    stats = client.stats()
    assert stats.objects == 10
    assert stats.bytes_used == sum(len(m) + 64 * 2 * 32 * 4 for _, m, _ in items)
    assert client.delete([k for k, _, _ in items] + ["m@1@0@ff@float32"]) == 10
    stats = client.stats()
    assert (stats.objects, stats.bytes_used) == (0, 0)


def test_hits_misses_and_metrics_are_exported(client: KVStoreClient) -> None:
    client.put([item(0, torch.zeros(8, 2, 8))])
    client.get([CHUNK.layer(0).to_string(), CHUNK.layer(1).to_string()])
    stats = client.stats()
    assert (stats.hits, stats.misses) == (1, 1)
    text = client.metrics_text()
    for name in ("pdserve_kvstore_objects 1.0", "pdserve_kvstore_hits 1.0", "pdserve_kvstore_misses 1.0",
                 "pdserve_kvstore_put_seconds_count", "pdserve_kvstore_get_seconds_bucket",
                 "pdserve_kvstore_evictions"):
        assert name in text
    assert client.health() == "SERVING"


BAD_PUTS = {
    "malformed key": (lambda t: ("not-a-key", item(0, t)[1], tensor_to_buffer(t)), "malformed key"),
    "short metadata": (lambda t: (item(0, t)[0], item(0, t)[1][:-4], tensor_to_buffer(t)), "bad metadata"),
    "payload size": (lambda t: (item(0, t)[0], item(0, t)[1], tensor_to_buffer(t[:1])), "metadata says"),
    "over max object": (lambda t: item(0, torch.zeros(17 * 2**20 // 4)), "max_object_bytes"),
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_bad_puts_get_clear_errors_and_the_server_keeps_serving(client: KVStoreClient,
                                                                  case: str) -> None:
    make, message = BAD_PUTS[case]
    bad = make(torch.randn(16, 2, 8))
    with pytest.raises(KVStoreClientError, match=message):
        client.put([bad])
    assert client.get([bad[0]]) == [None]
    assert client.stats().objects == 0
    client.put([item(3, torch.ones(4, 2, 8))])
    assert client.lookup([CHUNK.layer(3).to_string()]) == 1


def test_object_over_the_capacity_is_refused_and_nothing_is_evicted(tmp_path: Path) -> None:
    opts = StoreOptions(capacity="1MiB", port=0)
    with KVStoreService(opts) as service, KVStoreClient(service.location) as c:
        c.put([item(0, torch.zeros(1000))])
        with pytest.raises(KVStoreClientError, match="at most 1048576 bytes per object"):
            c.put([item(1, torch.zeros(2**20 // 4 + 16))])
        assert c.stats().objects == 1
        # Only pinned objects left: a put that would need them gone is refused, nothing evicted.
        assert c.pin([CHUNK.layer(0).to_string()]) == 1
        c.put([item(2, torch.zeros(2**18 // 4))])
        c.pin([CHUNK.layer(2).to_string()])
        with pytest.raises(KVStoreClientError, match="no room for"):
            c.put([item(3, torch.zeros(int(0.9 * 2**20) // 4))])
        assert c.stats().objects == 2


def test_unknown_action_and_garbage_bodies_are_rejected(client: KVStoreClient) -> None:
    import pyarrow.flight as flight

    conn = client._link.conn()
    with pytest.raises(Exception, match="unknown action 'explode'"):
        list(conn.do_action(flight.Action("explode", b"")))
    with pytest.raises(Exception, match="lookup: body is not a LookupRequest"):
        list(conn.do_action(flight.Action("lookup", b"\xff\xff\xff")))
    with pytest.raises(KVStoreClientError, match="ttl_s must be > 0"):
        client.lease(["m@1@0@1@float32"], 0)
    assert client.health() == "SERVING"


def test_leased_objects_survive_pressure_and_bytes_stay_under_capacity() -> None:
    capacity = 4 * 2**20
    opts = StoreOptions(capacity=str(capacity), port=0)
    with KVStoreService(opts) as service, KVStoreClient(service.location) as c:
        t = torch.zeros(2**18 // 4)  # 256 KiB payloads
        first = [item(i, t, CacheEngineKey("m", 1, 0, 1, "float32")) for i in range(4)]
        c.put(first)
        assert c.lease([first[0][0], first[1][0]], 60) == 2
        assert c.pin([first[2][0]]) == 1
        for h in range(2, 40):
            c.put([item(0, t, CacheEngineKey("m", 1, 0, h, "float32"))])
            assert c.stats().bytes_used <= capacity
        assert c.exists([k for k, _, _ in first]) == [True, True, True, False]
        assert c.stats().evictions > 0


def _kill_mid_put_script(location: str, key: str, meta: bytes, nbytes: int) -> str:
    return textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {str(ROOT)!r})
        from kvstore.client import KVStoreClient
        data = np.full({nbytes}, 7, dtype=np.uint8)
        print("ready", flush=True)
        KVStoreClient({location!r}, use_shm=False).put([({key!r}, {meta!r}, data)])
        print("done", flush=True)
    """)


def test_a_client_killed_mid_put_never_leaves_a_partial_object(store: KVStoreService,
                                                               flight_client: KVStoreClient) -> None:
    client = flight_client
    nbytes = 16 * 2**20 - 64
    keys = []
    for attempt, delay in enumerate((0.0, 0.02, 0.05, 0.1, 0.3)):
        key = CacheEngineKey("m", 1, 0, 100 + attempt, "uint8").to_string()
        meta = RemoteMetadata.single((nbytes,), "uint8", MemoryFormat.BINARY).pack()
        script = _kill_mid_put_script(store.location, key, meta, nbytes)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        keys.append(key)
    time.sleep(0.5)  # let the server finish whatever had fully arrived
    seen_complete = 0
    for obj in client.get(keys):
        if obj is not None:  # the whole object arrived before the kill: it must be complete
            seen_complete += 1
            assert len(obj.data) == nbytes
            assert bool((np.frombuffer(obj.data, dtype=np.uint8) == 7).all())
    assert client.health() == "SERVING"
    assert client.stats().objects == seen_complete


def test_client_times_out_on_a_stalled_server() -> None:
    class SlowBackend(MemoryBackend):
        def get(self, key: str) -> KVObject | None:
            time.sleep(1.0)
            return super().get(key)

    with (KVStoreService(StoreOptions(port=0), backend=SlowBackend(2**20)) as service,
          KVStoreClient(service.location, timeout_s=0.2) as c,
          pytest.raises(KVStoreClientError, match="timed out")):
        c.get(["m@1@0@1@float32"])


def test_client_reconnects_after_a_server_restart() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = StoreOptions(port=port)
    c = KVStoreClient(f"grpc://127.0.0.1:{port}", timeout_s=5)
    with KVStoreService(opts):
        c.put([item(0, torch.ones(4, 2, 8))])
    with KVStoreService(opts):  # a new, empty server on the same port
        assert c.get([CHUNK.layer(0).to_string()]) == [None]
        c.put([item(0, torch.ones(4, 2, 8))])
        assert c.lookup([CHUNK.layer(0).to_string()]) == 1
    c.close()


def test_redis_backend_behind_the_flight_server(redis_url: str) -> None:
    opts = StoreOptions(backend="redis", redis_url=redis_url, port=0)
    with KVStoreService(opts) as service, KVStoreClient(service.location) as c:
        layers = [torch.randn(32, 2, 16) for _ in range(3)]
        c.put([item(i, t) for i, t in enumerate(layers)])
        got = c.get([CHUNK.layer(i).to_string() for i in range(3)])
        for obj, want in zip(got, layers, strict=True):
            assert obj is not None
            assert torch.equal(buffer_to_tensor(obj.data, torch.float32, want.shape), want)
        assert c.stats().backend == "redis"


def test_cli_serves_until_sigterm() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "kvstore", "--port", str(port),
                             "--capacity", "64MiB", "--log-level", "WARNING"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        assert "memory backend on grpc://127.0.0.1:" in proc.stdout.readline()
        with KVStoreClient(f"grpc://127.0.0.1:{port}", timeout_s=10) as c:
            assert c.health() == "SERVING"
            c.put([item(0, torch.ones(4, 2, 8))])
            assert c.stats().objects == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("streams", [1, 3, 4])
def test_large_objects_travel_in_parallel_parts_and_ranges(store: KVStoreService, streams: int) -> None:
    """Objects over split_put_bytes go out as parts over several streams, objects over
    parallel_bytes come back in byte ranges; the bytes are the same whatever the split."""
    with KVStoreClient(store.location, streams=streams, parallel_bytes=64 * 1024,
                       split_put_bytes=64 * 1024, use_shm=False) as c:
        tensors = [torch.randn(n) for n in (1000, 100_003, 600_001)]
        c.put([item(i, t) for i, t in enumerate(tensors)])
        keys = [CHUNK.layer(i).to_string() for i in range(len(tensors))]
        for obj, want in zip(c.get(keys), tensors, strict=True):
            assert obj is not None
            assert torch.equal(buffer_to_tensor(obj.data, torch.float32, want.shape), want)
        outs = [torch.empty_like(t) for t in tensors]
        c.get_into(keys, [o.numpy() for o in outs])
        assert all(torch.equal(o, t) for o, t in zip(outs, tensors, strict=True))
        assert c.stats().objects == 3


def test_parts_that_overlap_or_overflow_are_rejected_and_nothing_is_stored(
        flight_client: KVStoreClient) -> None:
    client = flight_client
    import pyarrow.flight as flight

    from kvstore.wire import SCHEMA, object_batch
    from protos import kvstore_pb2 as pb

    t = torch.randn(1000)
    key, meta, _ = item(0, t)
    payload = t.numpy().view(np.uint8)
    desc = flight.FlightDescriptor.for_command(pb.PutRequest().SerializeToString())
    cases = (([(0, 3000), (2000, 2000)], 4000, "overlaps"), ([(2500, 1000)], 3000, "does not fit"))
    for parts, total, message in cases:
        writer, _ = client._link.conn().do_put(desc, SCHEMA)
        with pytest.raises(Exception, match=message):
            for off, n in parts:
                writer.write_batch(object_batch(key, meta, payload[off:off + n], offset=off, total=total))
            writer.close()
    assert client.get([key]) == [None]
    assert client.health() == "SERVING"


def test_an_object_put_in_parts_reads_whole_over_lm_and_from_redis(redis_url: str) -> None:
    """The memory backend keeps a parallel put as its parts; the lm:// server and the Redis
    backend see one contiguous payload, byte for byte."""
    from kvstore.lm_client import LMClient

    tensor = torch.randn(300_001)
    key, meta, payload = item(0, tensor)
    for opts in (StoreOptions(capacity="64MiB", port=0, lm_port=0),
                 StoreOptions(backend="redis", redis_url=redis_url, port=0)):
        with KVStoreService(opts) as service, \
             KVStoreClient(service.location, streams=3, split_put_bytes=4096, use_shm=False) as c:
            c.put([(key, meta, payload)])
            obj = c.get([key])[0]
            assert obj is not None and obj.data.to_pybytes() == tensor.numpy().tobytes()
            if service.lm_server is not None:
                with LMClient("127.0.0.1", service.lm_server.port, timeout_s=10) as lm:
                    got = lm.get(key)
                assert got is not None and bytes(got[1]) == tensor.numpy().tobytes()
