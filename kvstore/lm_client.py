"""A blocking client of LMCache 0.5.6's `lm://` protocol: talks to `lmcache_server` or LMServer.

One TCP connection, used by one request at a time (a lock makes the client thread-safe). Every
socket operation is bounded by `timeout_s`; a timeout drops the connection (its state is
unknown) and raises TimeoutError. A broken connection (reset, closed by the server, refused) is
re-opened and the request retried once; the second failure raises ConnectionError.

The protocol has no reply to PUT: `put` returns once the bytes are sent, and a server that
cannot store them (too large, full) says nothing. A GET on the same client afterwards is
ordered after the PUT, so `exists`/`get` confirm a put when that matters.

`list()` works against LMServer only: `lmcache_server` never answers LIST, so there it raises
TimeoutError after `timeout_s`.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

from kvstore.lm_protocol import (
    INT32_MAX,
    PLACEHOLDER_KEY,
    SERVER_HEADER_BYTES,
    ClientCommand,
    ClientMeta,
    ServerMeta,
    ServerReturnCode,
    binary_meta,
    check_payload,
    send_payload,
)
from kvstore.lmcache_format import RemoteMetadata

T = TypeVar("T")
BytesLike = bytes | bytearray | memoryview


class _PeerClosed(ConnectionError):
    pass


class LMCommandFailed(Exception):
    """The server answered FAIL to a command whose failure has no other meaning (LIST)."""


class LMClient:
    def __init__(self, host: str, port: int, timeout_s: float = 10.0, *,
                 max_payload_bytes: int = INT32_MAX) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.max_payload_bytes = max_payload_bytes
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def put(self, key: str, data: BytesLike, meta: RemoteMetadata | None = None) -> None:
        """Sends `data` under `key` with `meta` as its header (one group, e.g.
        `RemoteMetadata.single(shape, dtype, fmt)`); it defaults to LMCache's description of plain
        bytes. ValueError when `meta.length` is not `data`'s size or its tensor is of another size
        (LMCache could not read it)."""
        view = memoryview(data).cast("B")
        meta = meta or binary_meta(view.nbytes)
        if meta.length != view.nbytes:
            raise ValueError(f"meta.length is {meta.length}, payload is {view.nbytes}")
        check_payload(meta)
        encoded = ClientMeta(ClientCommand.PUT, key, meta).encode()

        def op(sock: socket.socket) -> None:
            sock.sendall(encoded)
            send_payload(sock, view)

        self._call(op)

    def get(self, key: str) -> tuple[RemoteMetadata, bytearray] | None:
        """The object's header (length, fmt, dtype, shape) and bytes, or None when the server has
        no such key."""
        request = ClientMeta(ClientCommand.GET, key).encode()

        def op(sock: socket.socket) -> tuple[RemoteMetadata, bytearray] | None:
            reply = self._request(sock, request)
            if reply.code != ServerReturnCode.SUCCESS:
                return None
            return reply.meta, self._recv_payload(sock, reply.length)

        return self._call(op)

    def exists(self, key: str) -> bool:
        request = ClientMeta(ClientCommand.EXIST, key).encode()
        return self._call(lambda sock: self._request(sock, request).code == ServerReturnCode.SUCCESS)

    def list(self) -> list[str]:
        """Every key the server holds (LMServer only; see the module docstring)."""
        request = ClientMeta(ClientCommand.LIST, PLACEHOLDER_KEY).encode()

        def op(sock: socket.socket) -> bytearray | None:
            reply = self._request(sock, request)
            if reply.code != ServerReturnCode.SUCCESS:
                return None
            return self._recv_payload(sock, reply.length)

        body = self._call(op)
        if body is None:
            raise LMCommandFailed(f"{self.url} does not list its keys")
        return body.decode().split("\n") if body else []

    def health(self) -> bool:
        """True when the server answers HEALTH with SUCCESS within the timeout; never raises."""
        request = ClientMeta(ClientCommand.HEALTH, PLACEHOLDER_KEY).encode()
        try:
            return self._call(lambda sock: self._request(sock, request).code == ServerReturnCode.SUCCESS)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> LMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: Callable[[socket.socket], T]) -> T:
        with self._lock:
            for attempt in (1, 2):
                try:
                    return op(self._connection())
                except TimeoutError as e:
                    self._drop()
                    raise TimeoutError(f"{self.url}: no answer in {self.timeout_s} s") from e
                except ValueError:
                    self._drop()  # a reply that does not decode: the stream is out of step
                    raise
                except OSError as e:  # reset, broken pipe, refused, closed by the peer
                    self._drop()
                    if attempt == 2:
                        raise ConnectionError(f"{self.url}: {e or type(e).__name__}") from e
            raise AssertionError("unreachable")

    def _connection(self) -> socket.socket:
        if self._sock is not None and _closed_by_peer(self._sock):
            self._drop()
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _request(self, sock: socket.socket, request: bytes) -> ServerMeta:
        sock.sendall(request)
        return ServerMeta.decode(_recv_exact(sock, SERVER_HEADER_BYTES))

    def _recv_payload(self, sock: socket.socket, n: int) -> bytearray:
        if n > self.max_payload_bytes:
            raise ValueError(f"{self.url} announced {n} payload bytes, over max_payload_bytes "
                             f"{self.max_payload_bytes}")
        return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise _PeerClosed(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle connection is readable only when the server closed it (or sent junk): either way
    it cannot carry the next request."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
