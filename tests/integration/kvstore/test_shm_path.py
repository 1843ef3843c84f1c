"""The KV store's same-host data path (kvstore/shm.py) with a real server on loopback: payloads
go as files in the server's directory and come back byte for byte; files follow the objects
(deleted with them, never left behind); every way the path can fail falls back to Flight with
the same result; bad shm_put requests get clear errors and delete what they named."""

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

import pytest
import torch

from kvstore.client import KVStoreClient, KVStoreRejectedError
from kvstore.lmcache_format import (
    CacheEngineKey,
    MemoryFormat,
    RemoteMetadata,
    buffer_to_tensor,
    tensor_to_buffer,
)
from kvstore.service import KVStoreService, StoreOptions
from kvstore.shm import OWNER_FILE, PREFIX, ShmArea
from protos import kvstore_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]
CHUNK = CacheEngineKey("smollm2-135m-instruct", 1, 0, 0x5EED, "float32")


def item(layer: int, tensor: torch.Tensor) -> tuple[str, bytes, object]:
    meta = RemoteMetadata.single(tuple(tensor.shape), tensor.dtype, MemoryFormat.KV_T2D).pack()
    return CHUNK.layer(layer).to_string(), meta, tensor_to_buffer(tensor)


def key(layer: int) -> str:
    return CHUNK.layer(layer).to_string()


def files(service: KVStoreService) -> list[str]:
    assert service.server.shm is not None
    return sorted(n for n in os.listdir(service.server.shm.dir) if not n.startswith("."))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStoreService]:
    with KVStoreService(StoreOptions(capacity="8MiB", port=0, shm_dir=str(tmp_path))) as s:
        yield s


def test_payloads_go_through_files_and_come_back_bit_exact(store: KVStoreService) -> None:
    layers = [torch.randn(256, 2, 192) for _ in range(3)] + [torch.randn(8, 2, 4).bfloat16()]
    with KVStoreClient(store.location) as c:
        assert c.shm_dir() == store.server.shm.dir  # type: ignore[union-attr]
        c.put([item(i, t) for i, t in enumerate(layers)])
        assert files(store) == ["obj-0", "obj-1", "obj-2", "obj-3"]  # adopted, none left as put-*
        for obj, want in zip(c.get([key(i) for i in range(4)]), layers, strict=True):
            assert obj is not None
            assert torch.equal(buffer_to_tensor(obj.data, want.dtype, want.shape), want)
        seen = [(i, None if o is None else bytes(o.data))
                for i, o in c.get_stream([key(0), "m@1@0@ab@float", key(3)])]
        assert seen == [(0, layers[0].numpy().tobytes()), (1, None),
                        (2, layers[3].view(torch.uint8).numpy().tobytes())]
        outs = [torch.empty_like(t) for t in layers[:2]]
        assert None not in c.get_into([key(0), key(1)], [o.view(torch.uint8).numpy() for o in outs])
        assert torch.equal(outs[0], layers[0]) and torch.equal(outs[1], layers[1])
        stats = c.stats()
        assert (stats.objects, stats.hits) == (4, 4 + 2 + 2)
    # A Flight reader gets the same bytes out of the server's files.
    with KVStoreClient(store.location, use_shm=False) as flight:
        obj = flight.get([key(2)])[0]
        assert obj is not None and bytes(obj.data) == layers[2].numpy().tobytes()


def test_files_go_with_their_objects(store: KVStoreService) -> None:
    with KVStoreClient(store.location) as c:
        c.put([item(i, torch.randn(64, 2, 32)) for i in range(4)])
        c.put([item(0, torch.randn(64, 2, 32))])  # replaced: the old file goes
        assert len(files(store)) == 4
        assert c.delete([key(1), key(2)]) == 2
        assert len(files(store)) == 2
        big = [item(10 + i, torch.randn(2**20 // 4)) for i in range(9)]  # 9 x 1 MiB into 8 MiB
        c.put(big)
        stats = c.stats()
        assert stats.evictions > 0 and stats.bytes_used <= stats.capacity_bytes
        assert len(files(store)) == stats.objects
        c.delete([k for k, _, _ in big] + [key(0), key(3)])
        assert files(store) == [] and c.stats().bytes_used == 0


def test_objects_put_over_flight_are_read_over_flight(store: KVStoreService) -> None:
    t = torch.randn(100, 2, 16)
    with KVStoreClient(store.location, use_shm=False) as flight:
        flight.put([item(0, t)])
    assert files(store) == []
    with KVStoreClient(store.location) as c:
        obj = c.get([key(0)])[0]
        assert obj is not None and torch.equal(buffer_to_tensor(obj.data, t.dtype, t.shape), t)
        assert [i for i, o in c.get_stream([key(0)]) if o is not None] == [0]


def test_bad_puts_are_refused_clearly_and_their_files_deleted(store: KVStoreService) -> None:
    t = torch.randn(16, 2, 8)
    with KVStoreClient(store.location) as c:
        with pytest.raises(KVStoreRejectedError, match="metadata says"):
            c.put([(key(0), item(0, t)[1], tensor_to_buffer(t[:2]))])
        with pytest.raises(KVStoreRejectedError, match="malformed key"):
            c.put([("not-a-key", item(0, t)[1], tensor_to_buffer(t))])
        assert files(store) == [] and c.stats().objects == 0
        directory = c.shm_dir()
        assert directory is not None
        Path(directory, "put-sized").write_bytes(b"x" * 10)
        cases = [("../etc/passwd", 10, "not a put-\\* name"), (".token", 32, "not a put-\\* name"),
                 ("obj-0", 10, "not a put-\\* name"), ("put-missing", 10, "no file"),
                 ("put-sized", 11, "holds 10 bytes")]
        for name, size, message in cases:
            req = pb.ShmPutRequest(objects=[pb.ShmObject(key=key(0), metadata=b"", file=name,
                                                         size=size)])
            with pytest.raises(KVStoreRejectedError, match=message):
                c._action("shm_put", req, pb.CountResponse)
        assert files(store) == []  # the wrongly sized file was deleted with its refusal
        # Each refusal counted once: 2 puts through files + the 5 requests above.
        assert 'pdserve_kvstore_errors_total{op="shm_put"} 7.0' in c.metrics_text()
        assert os.path.exists(Path(directory, ".token"))
        c.put([item(1, t)])  # still serving, still through files
        assert len(files(store)) == 1 and files(store)[0].startswith("obj-")


def test_a_client_that_cannot_see_the_directory_uses_flight(store: KVStoreService) -> None:
    shm = store.server.shm
    assert shm is not None
    Path(shm.dir, ".token").write_text("another machine's token")
    t = torch.randn(32, 2, 8)
    with KVStoreClient(store.location) as c:
        assert c.shm_dir() is None
        c.put([item(0, t)])
        obj = c.get([key(0)])[0]
        assert obj is not None and torch.equal(buffer_to_tensor(obj.data, t.dtype, t.shape), t)
    assert files(store) == []


def test_a_store_without_the_path_and_a_restarted_store(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvstore.shm_client.SHM_RETRY_S", 0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = torch.randn(32, 2, 8)
    with KVStoreService(StoreOptions(port=port, shm_dir="off")) as off:
        assert off.server.shm is None
        with KVStoreClient(off.location) as c:
            assert c.shm_dir() is None
            c.put([item(0, t)])
            assert c.get([key(0)])[0] is not None
            streamed = [(i, None if o is None else bytes(o.data)) for i, o in c.get_stream([key(0)])]
            assert streamed == [(0, t.numpy().tobytes())]
    c = KVStoreClient(f"grpc://127.0.0.1:{port}", timeout_s=5)
    with KVStoreService(StoreOptions(port=port, shm_dir=str(tmp_path))) as first:
        c.put([item(0, t)])
        old_dir = c.shm_dir()
        assert old_dir == first.server.shm.dir  # type: ignore[union-attr]
    assert old_dir is not None and not os.path.exists(old_dir)  # removed at stop
    with KVStoreService(StoreOptions(port=port, shm_dir=str(tmp_path))) as second:
        assert c.get([key(0)]) == [None]
        c.put([item(0, t)])  # the cached directory is gone: Flight for a while, then ask again
        assert c.shm_dir() is None and files(second) == []
        time.sleep(0.35)
        assert c.shm_dir() == second.server.shm.dir  # type: ignore[union-attr]
        c.put([item(1, t)])
        assert len(files(second)) >= 1
        obj = c.get([key(1)])[0]
        assert obj is not None and torch.equal(buffer_to_tensor(obj.data, t.dtype, t.shape), t)
    c.close()


def test_redis_and_lm_readers_see_objects_put_through_files(redis_url: str, tmp_path: Path) -> None:
    from kvstore.lm_client import LMClient

    t = torch.randn(1000, 2, 8)
    for opts in (StoreOptions(capacity="64MiB", port=0, lm_port=0, shm_dir=str(tmp_path)),
                 StoreOptions(backend="redis", redis_url=redis_url, port=0, shm_dir=str(tmp_path))):
        with KVStoreService(opts) as service, KVStoreClient(service.location) as c:
            assert c.shm_dir() is not None
            c.put([item(0, t)])
            obj = c.get([key(0)])[0]
            assert obj is not None and bytes(obj.data) == t.numpy().tobytes()
            if service.lm_server is not None:
                with LMClient("127.0.0.1", service.lm_server.port, timeout_s=10) as lm:
                    got = lm.get(key(0))
                assert got is not None and bytes(got[1]) == t.numpy().tobytes()
            else:  # Redis copied the payload: no file stays behind
                assert files(service) == []


def test_a_writer_killed_mid_put_leaves_no_object_and_its_file_is_swept(store: KVStoreService) -> None:
    nbytes = 6 * 2**20
    k = CacheEngineKey("m", 1, 0, 0xBEEF, "uint8").to_string()
    meta = RemoteMetadata.single((nbytes,), "uint8", MemoryFormat.BINARY).pack()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from kvstore import shm
        from kvstore.client import KVStoreClient
        c = KVStoreClient({store.location!r})
        shm.write_file(c.shm_dir(), b"x" * {nbytes})  # written, never handed over
        print("ready", flush=True)
        c.put([({k!r}, {meta!r}, b"y" * {nbytes})])
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert proc.wait(timeout=30) == -signal.SIGKILL
    orphans = [n for n in files(store) if n.startswith("put-")]
    assert len(orphans) == 1
    area = store.server.shm
    assert area is not None
    old = time.time() - 3600
    os.utime(os.path.join(area.dir, orphans[0]), (old, old))
    assert area.sweep(every_s=0) == 1
    with KVStoreClient(store.location) as c:
        obj = c.get([k])[0]
        assert obj is not None and bytes(obj.data) == b"y" * nbytes
    assert files(store) == ["obj-0"]


def test_a_directory_left_by_a_dead_store_is_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{PREFIX}{dead.pid}-gone"
    left.mkdir()
    (left / OWNER_FILE).write_text(f"{socket.gethostname()} {dead.pid}")
    (left / "obj-0").write_bytes(b"stale")
    other_host = tmp_path / f"{PREFIX}1-other"
    other_host.mkdir()
    (other_host / OWNER_FILE).write_text(f"not-{socket.gethostname()} {dead.pid}")
    area = ShmArea(str(tmp_path))
    try:
        assert not left.exists()
        assert other_host.exists()  # another host's (a shared volume): not ours to judge
        assert Path(area.dir).exists()
    finally:
        area.close()
    assert not Path(area.dir).exists()


def test_the_default_directory_lives_under_dev_shm_and_goes_at_stop() -> None:
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    with KVStoreService(StoreOptions(capacity="8MiB", port=0)) as service:
        shm = service.server.shm
        assert shm is not None and shm.dir.startswith(f"/dev/shm/{PREFIX}")
        with KVStoreClient(service.location) as c:
            c.put([item(0, torch.ones(4, 2, 8))])
        directory = shm.dir
    assert not os.path.exists(directory)


def test_a_full_directory_falls_back_to_flight(store: KVStoreService,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs full (ENOSPC while writing): the put goes over Flight, nothing is left behind, and
    the client stays on Flight for a while instead of failing every put again."""
    import errno

    from kvstore import shm as shm_module

    def full(directory: str, data: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    t = torch.randn(64, 2, 16)
    with KVStoreClient(store.location) as c:
        assert c.shm_dir() is not None
        monkeypatch.setattr(shm_module, "write_file", full)
        c.put([item(0, t)])
        assert c.shm_dir() is None
        obj = c.get([key(0)])[0]
        assert obj is not None and torch.equal(buffer_to_tensor(obj.data, t.dtype, t.shape), t)
    assert files(store) == []


def test_shm_counters_count_only_payloads_that_went_as_files(store: KVStoreService) -> None:
    def count(name: str) -> float | None:
        return store.server.metrics.registry.get_sample_value(f"pdserve_kvstore_shm_{name}_objects_total")

    with KVStoreClient(store.location) as c:
        c.put([item(i, torch.randn(8, 2, 4)) for i in range(2)])
        assert c.get([key(0), key(1), "m@1@0@ab@float"])[2] is None
    assert (count("put"), count("get")) == (2, 2)  # a key not found moved nothing
    with KVStoreClient(store.location, use_shm=False) as flight:
        flight.put([item(5, torch.randn(8, 2, 4))])
        assert flight.get([key(5)])[0] is not None and flight.get([key(0)])[0] is not None
    assert (count("put"), count("get")) == (2, 2)
