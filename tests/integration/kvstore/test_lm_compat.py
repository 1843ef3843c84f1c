"""LMCache 0.5.6 `lm://` compatibility, proven against the real package (run in its own venv):

- our codec's bytes equal LMCache's `ClientMetaMessage` / `ServerMetaMessage` / `RemoteMetadata`
  serializations, and LMCache decodes ours;
- (a) against the real `lmcache_server`: what our LMClient puts, LMCache's own `lm://` connector
  reads, and the other way round;
- (b) the same exchange against our LMServer, whose stored objects carry LMCache's RemoteMetadata;
- (c) our LMServer on bad clients: a put cut off or stalled mid-payload stores nothing, oversize
  and malformed requests are refused, and the server keeps serving.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvstore.backend import Backend, BackendStats, KVObject
from kvstore.lm_client import LMClient, LMCommandFailed
from kvstore.lm_protocol import (
    MAX_KEY_LENGTH,
    ClientCommand,
    ClientMeta,
    Location,
    ServerMeta,
    ServerReturnCode,
    binary_meta,
)
from kvstore.lm_server import LMServer
from kvstore.lmcache_format import MemoryFormat, RemoteMetadata
from services.procs import free_port

REPO = Path(__file__).resolve().parents[3]
LMCACHE_BIN = REPO / ".peers" / "lmcache" / "bin"
SCRIPTS = Path(__file__).resolve().parent / "lmcache_scripts"
SHAPE = (2, 2, 16, 16)  # KV_2LTD: [2, layers, tokens, hidden]
NBYTES = int(np.prod(SHAPE)) * 4
START_TIMEOUT_S = 60.0


def _needs_lmcache() -> None:
    if not (LMCACHE_BIN / "python").exists():
        pytest.skip(f"LMCache 0.5.6 venv missing at {LMCACHE_BIN.parent}: "
                    "run `bash kvstore/peers/install_lmcache.sh`")


def _run_lmcache(script: str, args: Sequence[str], request: dict) -> dict:
    cmd = [str(LMCACHE_BIN / "python"), str(SCRIPTS / script), *args]
    proc = subprocess.run(cmd, input=json.dumps(request), capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


class DictBackend(Backend):
    """The smallest Backend: a dict, plus `keys()` so LIST has something to answer."""

    name = "dict"

    def __init__(self) -> None:
        self.objects: dict[str, KVObject] = {}

    def put(self, key: str, obj: KVObject, ttl_s: float | None = None) -> None:
        self.objects[key] = obj

    def get(self, key: str) -> KVObject | None:
        return self.objects.get(key)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self.objects.pop(k, None) is not None for k in keys)

    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        return 0

    def release(self, keys: Sequence[str]) -> int:
        return 0

    def pin(self, keys: Sequence[str]) -> int:
        return 0

    def unpin(self, keys: Sequence[str]) -> int:
        return 0

    def stats(self) -> BackendStats:
        return BackendStats(len(self.objects), 0, 0, 0, 0, 0, 0, 0)

    def keys(self) -> list[str]:
        return list(self.objects)


def _memory_backend() -> Backend:
    try:
        from kvstore.backends.memory import MemoryBackend
    except ImportError:
        return DictBackend()
    return MemoryBackend(capacity_bytes=64 << 20)


@pytest.fixture(scope="module")
def lmcache_server() -> Iterator[int]:
    """Port of a real `lmcache_server 127.0.0.1 PORT` (LMCache's in-memory lm:// server)."""
    _needs_lmcache()
    for _attempt in range(3):
        port = free_port()
        proc = subprocess.Popen([str(LMCACHE_BIN / "lmcache_server"), "127.0.0.1", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not _accepts(port):
            time.sleep(0.2)
        try:
            if proc.poll() is None and _accepts(port):
                yield port
                return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    pytest.fail("lmcache_server did not start on 127.0.0.1")


@pytest.fixture
def lm_server() -> Iterator[LMServer]:
    server = LMServer(_memory_backend(), max_payload_bytes=1 << 20, io_timeout_s=0.5).start()
    try:
        yield server
    finally:
        server.stop()


def _key(name: str) -> str:
    return f"compat@1@0@{abs(hash(name)) & 0xFFFFFFFF:x}@float"  # a CacheEngineKey LMCache parses


def _tensor(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32)


# --- codec -------------------------------------------------------------------------------------


def test_codec_bytes_equal_lmcache_serializations_and_lmcache_decodes_ours() -> None:
    _needs_lmcache()
    key = "compat@1@0@1f2e3d@float@3"  # a LayerCacheEngineKey
    tensor = RemoteMetadata.single(SHAPE, "float32", MemoryFormat.KV_2LTD)
    put = ClientMeta(ClientCommand.PUT, key, tensor, Location.LOCAL_CPU)
    get = ClientMeta(ClientCommand.GET, "m@1@0@ab@half")
    blob = ClientMeta(ClientCommand.PUT, "m@2@1@ab@bfloat16", binary_meta(40))
    t2d = RemoteMetadata.single((3, 2, 576), "bfloat16", MemoryFormat.KV_T2D)
    ok = ServerMeta(ServerReturnCode.SUCCESS, t2d, Location.LOCAL_DISK)
    remote = RemoteMetadata(NBYTES, (SHAPE,), ("float16",), MemoryFormat.KV_2LTD)
    two_groups = RemoteMetadata(64, ((2, 1, 2, 2), (2, 1, 4, 2)), ("float32", "bfloat16"),
                                MemoryFormat.KV_2LTD)
    request: dict[str, list] = {
        "client": [
            {"command": "PUT", "key": key, "length": NBYTES, "fmt": "KV_2LTD", "dtype": "float32",
             "shape": list(SHAPE), "location": "LocalCPUBackend"},
            {"command": "GET", "key": "m@1@0@ab@half", "length": 0, "fmt": "KV_2LTD", "dtype": "float16",
             "shape": [0, 0, 0, 0], "location": None},
            {"command": "PUT", "key": "m@2@1@ab@bfloat16", "length": 40, "fmt": "BINARY", "dtype": "uint8",
             "shape": [40, 0, 0, 0], "location": None},
        ],
        "server": [
            {"code": "SUCCESS", "length": 3 * 2 * 576 * 2, "fmt": "KV_T2D", "dtype": "bfloat16",
             "shape": [3, 2, 576], "location": "LocalDiskBackend"},
            {"code": "FAIL", "length": 0, "fmt": "KV_2LTD", "dtype": "float16", "shape": [0, 0, 0, 0],
             "location": None},
        ],
        "remote": [
            {"length": NBYTES, "fmt": "KV_2LTD", "dtypes": ["float16"], "shapes": [list(SHAPE)]},
            {"length": 64, "fmt": "KV_2LTD", "dtypes": ["float32", "bfloat16"],
             "shapes": [[2, 1, 2, 2], [2, 1, 4, 2]]},
        ],
        "decode_client": [put.encode().hex()],
        "decode_server": [ok.encode().hex()],
        "decode_remote": [remote.pack().hex()],
    }
    out = _run_lmcache("lm_protocol_codec.py", [], request)
    assert out["client"] == [put.encode().hex(), get.encode().hex(), blob.encode().hex()]
    assert out["server"] == [ok.encode().hex(), ServerMeta(ServerReturnCode.FAIL).encode().hex()]
    assert out["remote"] == [remote.pack().hex(), two_groups.pack().hex()]
    assert out["decode_client"] == [request["client"][0]]
    assert out["decode_server"] == [request["server"][0]]
    assert out["decode_remote"] == [request["remote"][0]]
    assert len(bytes.fromhex(out["client"][0])) == 36 + MAX_KEY_LENGTH


# --- (a) and (b): our client and LMCache's connector share objects through either server --------


def _exchange_with_lmcache_connector(port: int, workdir: Path) -> tuple[str, str]:
    """Our client puts key A; LMCache's connector puts key B and reads A and B; we read B.
    Returns (A, B)."""
    ours, theirs, absent = _key(f"ours-{port}"), _key(f"theirs-{port}"), _key(f"absent-{port}")
    tensor = _tensor(7)
    meta = RemoteMetadata.single(SHAPE, "float32", MemoryFormat.KV_2LTD)
    with LMClient("127.0.0.1", port, timeout_s=10) as client:
        assert client.health()
        client.put(ours, tensor.tobytes(), meta)
        assert client.exists(ours)

        put = {"key": theirs, "fmt": "KV_2LTD", "dtype": "float32", "shape": list(SHAPE), "seed": 3}
        plan = {"put": [put], "exists": [ours, absent], "get": [ours, theirs, absent]}
        out = _run_lmcache("lm_connector_io.py", [f"lm://127.0.0.1:{port}", str(workdir)], plan)

        # LMCache read what we put: same bytes, and the tensor it rebuilt has our fmt/dtype/shape.
        assert out["exists"] == {ours: True, absent: False}
        read = out["get"][ours]
        assert (read["fmt"], read["dtype"], read["shape"]) == ("KV_2LTD", "float32", list(SHAPE))
        assert Path(read["file"]).read_bytes() == tensor.tobytes()
        assert out["get"][absent] is None

        # We read what LMCache put: its bytes and its header fields.
        written = Path(out["put"][0]["file"]).read_bytes()
        got = client.get(theirs)
        assert got is not None
        got_meta, data = got
        assert bytes(data) == written
        assert got_meta == meta
        assert np.array_equal(np.frombuffer(data, np.float32).reshape(got_meta.shapes[0]),
                              np.frombuffer(written, np.float32).reshape(SHAPE))
        assert Path(out["get"][theirs]["file"]).read_bytes() == written
        assert client.get(absent) is None and not client.exists(absent)
    return ours, theirs


def test_a_lmcache_server_serves_our_client_and_lmcache_connector_alike(lmcache_server: int,
                                                                          tmp_path: Path) -> None:
    _exchange_with_lmcache_connector(lmcache_server, tmp_path)


def test_a_list_is_unanswered_by_lmcache_server_so_client_times_out(lmcache_server: int) -> None:
    with LMClient("127.0.0.1", lmcache_server, timeout_s=0.5) as client:
        with pytest.raises(TimeoutError):
            client.list()
        assert client.health()  # the connection was replaced, not left out of step


def test_b_our_server_serves_lmcache_connector_and_stores_remote_metadata(lm_server: LMServer,
                                                                           tmp_path: Path) -> None:
    _needs_lmcache()
    ours, theirs = _exchange_with_lmcache_connector(lm_server.port, tmp_path)
    stored = lm_server.backend.get(theirs)
    assert stored is not None and len(stored.data) == NBYTES
    decoded = _run_lmcache("lm_protocol_codec.py", [], {"decode_remote": [stored.metadata.hex()]})
    assert decoded["decode_remote"] == [{"length": NBYTES, "fmt": "KV_2LTD", "dtypes": ["float32"],
                                         "shapes": [list(SHAPE)]}]
    ours_stored = lm_server.backend.get(ours)
    assert ours_stored is not None and ours_stored.metadata == stored.metadata  # same fmt/dtype/shape


# --- our server's own behaviour ---------------------------------------------------------------


def test_object_without_remote_metadata_is_served_as_lmcache_binary() -> None:
    backend = DictBackend()
    backend.put("k@1@0@1@half", KVObject(metadata=b"", data=b"abc"))
    with LMServer(backend) as server, LMClient("127.0.0.1", server.port) as client:
        assert client.get("k@1@0@1@half") == (binary_meta(3), bytearray(b"abc"))


def test_list_returns_keys_when_the_backend_can_list_them() -> None:
    with LMServer(DictBackend()) as server, LMClient("127.0.0.1", server.port) as client:
        assert client.list() == []
        client.put("a@1@0@1@half", b"x")
        client.put("b@1@0@2@half", b"yy")
        assert sorted(client.list()) == ["a@1@0@1@half", "b@1@0@2@half"]


def test_list_fails_cleanly_when_the_backend_cannot_list(lm_server: LMServer) -> None:
    with LMClient("127.0.0.1", lm_server.port) as client:
        if hasattr(lm_server.backend, "keys"):
            pytest.skip("this backend lists its keys")
        with pytest.raises(LMCommandFailed):
            client.list()
        assert client.health()


def test_c_client_disconnecting_mid_put_leaves_no_object(lm_server: LMServer) -> None:
    key = _key("cut")
    raw = socket.create_connection(("127.0.0.1", lm_server.port))
    raw.sendall(ClientMeta(ClientCommand.PUT, key, binary_meta(4096)).encode() + b"\x01" * 1000)
    assert _wait_until(lambda: lm_server.open_connections == 1)
    raw.close()
    assert _wait_until(lambda: lm_server.open_connections == 0)
    with LMClient("127.0.0.1", lm_server.port) as client:
        assert not client.exists(key) and client.get(key) is None
        client.put(key, b"\x02" * 4096)  # and the server still serves
        assert client.get(key) == (binary_meta(4096), bytearray(b"\x02" * 4096))


def test_c_client_stalling_mid_put_is_dropped_and_stores_nothing(lm_server: LMServer) -> None:
    key = _key("stall")
    with socket.create_connection(("127.0.0.1", lm_server.port)) as raw:
        raw.sendall(ClientMeta(ClientCommand.PUT, key, binary_meta(4096)).encode() + b"\x01" * 10)
        raw.settimeout(5)
        assert raw.recv(1) == b""  # the server closed it after io_timeout_s = 0.5
    assert lm_server.backend.get(key) is None


def test_oversize_put_is_discarded_and_the_connection_keeps_working(lm_server: LMServer) -> None:
    big, small = _key("big"), _key("small")
    with LMClient("127.0.0.1", lm_server.port) as client:
        client.put(big, bytes((1 << 20) + 1))
        client.put(small, b"ok")
        assert client.get(small) == (binary_meta(2), bytearray(b"ok"))
        assert not client.exists(big)


def test_put_whose_length_contradicts_its_shape_is_not_stored(lm_server: LMServer) -> None:
    key = _key("liar")
    liar = RemoteMetadata(8, (SHAPE,), ("float32",), MemoryFormat.KV_2LTD)
    with LMClient("127.0.0.1", lm_server.port) as client:
        with pytest.raises(ValueError, match="payload is 8"):
            client.put(key, bytes(8), liar)  # our client refuses to send it
        with pytest.raises(ValueError, match=f"meta.length is {NBYTES}, payload is 8"):
            client.put(key, bytes(8), RemoteMetadata.single(SHAPE, "float32", MemoryFormat.KV_2LTD))
        with socket.create_connection(("127.0.0.1", lm_server.port), timeout=5) as raw:
            raw.sendall(ClientMeta(ClientCommand.PUT, key, liar).encode() + bytes(8))
            raw.sendall(ClientMeta(ClientCommand.EXIST, key).encode())
            assert ServerMeta.decode(raw.recv(36)).code == ServerReturnCode.FAIL
        assert client.get(key) is None


def test_malformed_get_gets_fail_and_the_connection_keeps_working(lm_server: LMServer) -> None:
    bad = bytearray(ClientMeta(ClientCommand.GET, _key("x")).encode())
    bad[12:16] = (77).to_bytes(4, "little")  # dtype code 77
    with socket.create_connection(("127.0.0.1", lm_server.port), timeout=5) as raw:
        raw.sendall(bytes(bad))
        assert ServerMeta.decode(raw.recv(36)).code == ServerReturnCode.FAIL
        raw.sendall(ClientMeta(ClientCommand.HEALTH, "h@1@0@0@half").encode())
        assert ServerMeta.decode(raw.recv(36)).code == ServerReturnCode.SUCCESS


def test_unknown_command_closes_only_that_connection(lm_server: LMServer) -> None:
    bad = bytearray(ClientMeta(ClientCommand.GET, _key("x")).encode())
    bad[0:4] = (99).to_bytes(4, "little")
    with LMClient("127.0.0.1", lm_server.port) as other, \
            socket.create_connection(("127.0.0.1", lm_server.port), timeout=5) as raw:
        assert other.health()
        raw.sendall(bytes(bad))
        assert raw.recv(1) == b""
        assert other.health() and not other.exists(_key("x"))


def test_client_reconnects_once_after_the_server_restarts() -> None:
    backend = DictBackend()
    first = LMServer(backend).start()
    port = first.port
    client = LMClient("127.0.0.1", port, timeout_s=5)
    try:
        client.put("k@1@0@1@half", b"v")
        assert client.exists("k@1@0@1@half")  # PUT has no reply: confirm it before stopping
        first.stop()
        with LMServer(backend, port=port):
            assert client.get("k@1@0@1@half") == (binary_meta(1), bytearray(b"v"))
        with pytest.raises(ConnectionError):
            client.exists("k@1@0@1@half")  # nobody listens: one retry, then the error
        assert not client.health()
    finally:
        client.close()


def test_client_times_out_on_a_server_that_never_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        client = LMClient("127.0.0.1", silent.getsockname()[1], timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.exists("k@1@0@1@half")
        assert time.monotonic() - start < 3
        client.close()
