"""A TCP server speaking LMCache 0.5.6's `lm://` protocol in front of any kvstore Backend.

An LMCache engine configured with `remote_url: lm://host:port` (or our `LMClient`) talks to it
exactly as to `lmcache_server`. One thread per connection, many requests per connection, served
in order. A PUT is stored as `KVObject(metadata=header.pack(), data=payload)`, its header being
a one-group `kvstore.lmcache_format.RemoteMetadata`: the same object LMCache's Redis layout and
our Flight service hold. LMCache clients send no checksum (kvstore/integrity.py), so such an
object has none; a GET answers LMCache's bytes only, whatever checksum the object carries.

Differences from `lmcache_server`, all on inputs it mishandles:
- a client that disconnects (or stalls past `io_timeout_s`) mid-message stores nothing;
- a payload over `max_payload_bytes`, or whose length is not what its dtype and shape say, is
  read and discarded in small pieces, never allocated or stored;
- a header that does not decode gets FAIL when its command has a reply (GET, EXIST, LIST,
  HEALTH), has its payload discarded when it is a PUT with a sane length (PUT has no reply),
  and otherwise closes that connection; other connections keep being served;
- LIST is answered (newline-joined keys) when the backend has a `keys()` method, else FAIL;
- keys are stored as the client's strings (LMCache parses them into `CacheEngineKey`s, so two
  spellings of one key, like a zero-padded hash, would meet there and not here).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterable

import pyarrow as pa

from kvstore.backend import Backend, KVObject, KVStoreError
from kvstore.chunked import contiguous
from kvstore.lm_protocol import (
    CLIENT_HEADER_BYTES,
    FAIL_REPLY,
    INT32_MAX,
    SUCCESS_REPLY,
    ClientCommand,
    ClientMeta,
    ServerMeta,
    ServerReturnCode,
    binary_meta,
    check_payload,
    peek_command_and_length,
    send_payload,
)
from kvstore.lmcache_format import RemoteMetadata

log = logging.getLogger(__name__)

_DRAIN_CHUNK = 1 << 20
_REPLYING = (ClientCommand.GET, ClientCommand.EXIST, ClientCommand.LIST, ClientCommand.HEALTH)


class _Disconnected(Exception):
    """The peer closed, stalled past the timeout, or the server is stopping."""


class LMServer:
    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0, *,
                 max_payload_bytes: int = 1 << 30, io_timeout_s: float = 30.0,
                 max_connections: int = 256) -> None:
        if not 0 < max_payload_bytes <= INT32_MAX:
            raise ValueError(f"max_payload_bytes must be in (0, 2**31), got {max_payload_bytes}")
        if io_timeout_s <= 0 or max_connections <= 0:
            raise ValueError("io_timeout_s and max_connections must be positive")
        self.backend = backend
        self.host = host
        self.max_payload_bytes = max_payload_bytes
        self.io_timeout_s = io_timeout_s
        self.max_connections = max_connections
        self._requested_port = port
        self._listener: socket.socket | None = None
        self._port = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._accept_thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("LMServer is not started")
        return self._port

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> LMServer:
        if self._listener is not None:
            raise RuntimeError("LMServer already started")
        listener = socket.create_server((self.host, self._requested_port), backlog=64)
        listener.settimeout(0.2)  # the accept loop polls the stop flag
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="lm-accept", daemon=True)
        self._accept_thread.start()
        log.info("lm:// server on %s:%d", self.host, self.port)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Stops accepting, closes every connection (a PUT in flight is dropped), joins threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(grace_s)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(grace_s)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> LMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set():
                    break
                log.warning("lm:// accept failed: %s", e)  # e.g. out of file descriptors
                self._stopping.wait(0.1)
                continue
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    log.warning("lm:// connection from %s refused: %d open", addr, len(self._conns))
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,), name=f"lm-conn-{addr[1]}",
                                          daemon=True)
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._stopping.is_set() and self._serve_one(conn):
                pass
        except _Disconnected:
            pass
        except OSError as e:
            log.info("lm:// connection dropped: %s", e)
        except Exception:
            log.exception("lm:// connection failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Serves one request; False when the connection must close."""
        header = bytearray(CLIENT_HEADER_BYTES)
        self._recv_into(conn, memoryview(header), idle_first=True)
        try:
            msg = ClientMeta.decode(header)
        except ValueError as e:
            return self._on_malformed(conn, header, e)
        if msg.command == ClientCommand.PUT:
            self._put(conn, msg)
        elif msg.command == ClientCommand.GET:
            self._get(conn, msg.key)
        elif msg.command == ClientCommand.EXIST:
            conn.sendall(self._exists_reply(msg.key).encode())
        elif msg.command == ClientCommand.LIST:
            self._list(conn)
        else:
            conn.sendall(SUCCESS_REPLY.encode())
        return True

    def _on_malformed(self, conn: socket.socket, header: bytearray, error: ValueError) -> bool:
        command, length = peek_command_and_length(header)
        log.warning("lm:// malformed request (command %d): %s", command, error)
        if command in _REPLYING:
            conn.sendall(FAIL_REPLY.encode())
            return True
        if command == ClientCommand.PUT and length >= 0:
            self._drain(conn, length)
            return True
        return False

    def _put(self, conn: socket.socket, msg: ClientMeta) -> None:
        if msg.length > self.max_payload_bytes:
            log.warning("lm:// PUT %s rejected: %d bytes > max %d", msg.key, msg.length,
                        self.max_payload_bytes)
            self._drain(conn, msg.length)
            return
        try:
            check_payload(msg.meta)
        except ValueError as e:  # LMCache's connector could not receive it: do not serve it
            log.warning("lm:// PUT %s rejected: %s", msg.key, e)
            self._drain(conn, msg.length)
            return
        data = pa.allocate_buffer(msg.length)
        self._recv_into(conn, memoryview(data))
        obj = KVObject(metadata=msg.meta.pack(), data=data)
        try:
            self.backend.put(msg.key, obj)
        except KVStoreError as e:  # PUT has no reply: the client finds out on GET
            log.warning("lm:// PUT %s not stored: %s", msg.key, e)

    def _get(self, conn: socket.socket, key: str) -> None:
        try:
            obj = self.backend.get(key)
        except KVStoreError as e:
            log.warning("lm:// GET %s failed: %s", key, e)
            obj = None
        if obj is None or len(obj.data) > INT32_MAX:
            conn.sendall(FAIL_REPLY.encode())
            return
        reply = ServerMeta(ServerReturnCode.SUCCESS, _reply_meta_of(obj))
        conn.sendall(reply.encode())
        send_payload(conn, memoryview(contiguous(obj.data)))

    def _exists_reply(self, key: str) -> ServerMeta:
        try:
            present = self.backend.exists([key])[0]
        except KVStoreError as e:
            log.warning("lm:// EXIST %s failed: %s", key, e)
            present = False
        return SUCCESS_REPLY if present else FAIL_REPLY

    def _list(self, conn: socket.socket) -> None:
        keys = getattr(self.backend, "keys", None)
        if not callable(keys):
            conn.sendall(FAIL_REPLY.encode())
            return
        body = "\n".join(_as_strs(keys())).encode()
        reply = ServerMeta(ServerReturnCode.SUCCESS, binary_meta(len(body)))
        conn.sendall(reply.encode())
        conn.sendall(body)

    def _recv_into(self, conn: socket.socket, view: memoryview, idle_first: bool = False) -> None:
        """Fills `view`. With `idle_first`, waits without limit for the first byte (an idle
        connection between requests); every other wait is bounded by `io_timeout_s`."""
        got = 0
        conn.settimeout(None if idle_first else self.io_timeout_s)
        try:
            while got < len(view):
                n = conn.recv_into(view[got:])
                if n == 0:
                    if got or not idle_first:
                        log.info("lm:// peer closed mid-message (%d of %d bytes)", got, len(view))
                    raise _Disconnected
                got += n
                conn.settimeout(self.io_timeout_s)
        except TimeoutError:
            log.warning("lm:// peer stalled mid-message (%d of %d bytes)", got, len(view))
            raise _Disconnected from None

    def _drain(self, conn: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
        while n > 0:
            step = min(n, len(scratch))
            self._recv_into(conn, scratch[:step])
            n -= step


def _reply_meta_of(obj: KVObject) -> RemoteMetadata:
    """The GET reply's length/fmt/dtype/shape: the object's RemoteMetadata when it is one group
    that matches the payload, else LMCache's description of plain bytes."""
    try:
        meta: RemoteMetadata | None = RemoteMetadata.unpack(obj.metadata, num_groups=1)
    except ValueError:
        meta = None
    if meta is None or meta.length != len(obj.data):
        return binary_meta(len(obj.data))
    return meta


def _as_strs(keys: Iterable[object]) -> list[str]:
    return [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
