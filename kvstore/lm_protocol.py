"""Byte-exact codec of LMCache 0.5.6's `lm://` server protocol.

Wire format (LMCache `lmcache/v1/protocol.py`, native int32 = little-endian on our hosts):

- Client -> server header, 186 bytes: `command, length, fmt, dtype, location, shape0..shape3`
  (9 x int32), then the key: 150 bytes of UTF-8, right-padded with spaces (`str.ljust`).
  A PUT header is followed by `length` payload bytes; the server sends no reply to a PUT.
- Server -> client header, 36 bytes: `code, length, fmt, dtype, shape0..shape3, location`
  (9 x int32; note `location` moves to the end). A successful GET reply is followed by
  `length` payload bytes. EXIST answers SUCCESS (present) or FAIL (absent) with no payload.
- LIST is declared by LMCache but its server does not answer it; our server answers it the way
  LMCache's commented-out code sketches: SUCCESS, then `length` bytes of newline-joined keys.

A header's `length, fmt, dtype, shape0..shape3` are exactly one group of LMCache's
`RemoteMetadata` (the header LMCache stores beside a payload in its other remotes), so messages
carry a one-group `kvstore.lmcache_format.RemoteMetadata`, which owns the dtype codes (1 and 2
both read as float16; 2 is written) and the shape padding (BINARY formats keep their zeros).
Our server stores that header's packed bytes as the object's metadata, so the same object reads
identically through Redis and Flight.

Anything malformed raises ValueError with a message that says which field is wrong.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

from kvstore.lmcache_format import MemoryFormat, RemoteMetadata, payload_nbytes

MAX_KEY_LENGTH = 150
CLIENT_HEADER = struct.Struct(f"<9i{MAX_KEY_LENGTH}s")
SERVER_HEADER = struct.Struct("<9i")
CLIENT_HEADER_BYTES = CLIENT_HEADER.size  # 186
SERVER_HEADER_BYTES = SERVER_HEADER.size  # 36
INT32_MAX = 2**31 - 1

SEND_CHUNK_BYTES = 4 << 20

# A key that LMCache's server can parse (`parse_cache_key`), for commands whose key it ignores.
PLACEHOLDER_KEY = "pdserve@1@0@0@half"

E = TypeVar("E", bound=IntEnum)


class ClientCommand(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class ServerReturnCode(IntEnum):
    SUCCESS = 200
    FAIL = 400


class Location(IntEnum):
    NONE = 0
    LOCAL_CPU = 1  # "LocalCPUBackend"
    LOCAL_DISK = 2  # "LocalDiskBackend"


_BINARY_FORMATS = (MemoryFormat.BINARY, MemoryFormat.BINARY_BUFFER)
_GROUP = struct.Struct("<7i")  # one-group RemoteMetadata: length, fmt, dtype, 4 dims


def binary_meta(nbytes: int) -> RemoteMetadata:
    """How LMCache describes a plain bytes object: BINARY, uint8, `[nbytes, 0, 0, 0]`."""
    return RemoteMetadata(nbytes, ((nbytes, 0, 0, 0),), ("uint8",), MemoryFormat.BINARY)


# What LMCache sends with GET and EXIST, and in replies without a payload: fmt 1, float16, zeros.
NO_META = RemoteMetadata(0, ((0,),), ("float16",), MemoryFormat.KV_2LTD)


def check_payload(meta: RemoteMetadata) -> None:
    """ValueError unless `meta` is one group whose tensor (what LMCache allocates to receive it)
    is `meta.length` bytes; BINARY formats and dtype None are not sized by their shape."""
    _check_one_group(meta)
    dtype = meta.dtypes[0]
    if meta.fmt in _BINARY_FORMATS or dtype is None:
        return
    expected = payload_nbytes(meta.shapes[0], dtype)
    if expected != meta.length:
        raise ValueError(f"{meta.fmt.name} {dtype} {list(meta.shapes[0])} is {expected} bytes, "
                         f"payload is {meta.length}")


def _check_one_group(meta: RemoteMetadata) -> None:
    if meta.num_groups != 1:
        raise ValueError(f"an lm:// header carries one RemoteMetadata group, got {meta.num_groups}")


def _group_values(meta: RemoteMetadata) -> tuple[int, ...]:
    """`length, fmt, dtype, shape0..shape3` of a one-group RemoteMetadata, as packed."""
    _check_one_group(meta)
    return _GROUP.unpack(meta.pack())


def _meta_from_fields(length: int, fmt: int, dtype: int, dims: tuple[int, ...]) -> RemoteMetadata:
    return RemoteMetadata.unpack(_GROUP.pack(length, fmt, dtype, *dims))


def _unpack(layout: struct.Struct, buf: bytes | bytearray | memoryview, side: str) -> tuple:
    if len(buf) != layout.size:
        raise ValueError(f"{side} header must be {layout.size} bytes, got {len(buf)}")
    return layout.unpack(buf)


def _check_key(key: str) -> None:
    raw = key.encode()
    if not key or key != key.strip():
        raise ValueError(f"key must be non-empty without surrounding whitespace, got {key[:60]!r}")
    if len(raw) > MAX_KEY_LENGTH:
        raise ValueError(f"key is {len(raw)} bytes, more than LMCache's {MAX_KEY_LENGTH}")
    if "\x00" in key:
        raise ValueError(f"key contains a NUL byte: {key[:60]!r}")


def _check_enum(enum: type[IntEnum], value: int, what: str) -> None:
    _as_enum(enum, value, what)


def _as_enum(enum: type[E], value: int, what: str) -> E:
    try:
        return enum(value)
    except ValueError:
        known = ", ".join(f"{m.name}={m.value}" for m in enum)
        raise ValueError(f"unknown {what} {value} (known: {known})") from None


@dataclass(frozen=True)
class ClientMeta:
    """LMCache `ClientMetaMessage`. `meta.length` is the header's length (the PUT payload's byte
    count); the default `meta` is what LMCache sends with GET and EXIST."""

    command: ClientCommand
    key: str
    meta: RemoteMetadata = field(default=NO_META)
    location: int = Location.NONE

    def __post_init__(self) -> None:
        _check_enum(ClientCommand, self.command, "command")
        _check_enum(Location, self.location, "location")
        _check_key(self.key)
        _check_one_group(self.meta)

    @property
    def length(self) -> int:
        return self.meta.length

    def encode(self) -> bytes:
        length, fmt, dtype, *dims = _group_values(self.meta)
        return CLIENT_HEADER.pack(int(self.command), length, fmt, dtype, int(self.location), *dims,
                                  self.key.encode().ljust(MAX_KEY_LENGTH))

    @staticmethod
    def decode(buf: bytes | bytearray | memoryview) -> ClientMeta:
        command, length, fmt, dtype, location, *dims, raw_key = _unpack(CLIENT_HEADER, buf, "client")
        try:
            key = raw_key.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise ValueError(f"key is not UTF-8: {raw_key[:40]!r}...") from e
        return ClientMeta(_as_enum(ClientCommand, command, "command"), key,
                          _meta_from_fields(length, fmt, dtype, tuple(dims)),
                          _as_enum(Location, location, "location"))


def peek_command_and_length(buf: bytes | bytearray | memoryview) -> tuple[int, int]:
    """The raw command and length of a client header that `ClientMeta.decode` rejected, so a
    server can tell whether a payload follows it."""
    command, length = struct.unpack_from("<2i", buf)
    return command, length


@dataclass(frozen=True)
class ServerMeta:
    """LMCache `ServerMetaMessage`. `meta.length` is the reply's payload byte count; replies
    without a payload carry LMCache's placeholder fields (`NO_META`)."""

    code: ServerReturnCode
    meta: RemoteMetadata = field(default=NO_META)
    location: int = Location.NONE

    def __post_init__(self) -> None:
        _check_enum(ServerReturnCode, self.code, "return code")
        _check_enum(Location, self.location, "location")
        _check_one_group(self.meta)

    @property
    def length(self) -> int:
        return self.meta.length

    def encode(self) -> bytes:
        return SERVER_HEADER.pack(int(self.code), *_group_values(self.meta), int(self.location))

    @staticmethod
    def decode(buf: bytes | bytearray | memoryview) -> ServerMeta:
        code, length, fmt, dtype, d0, d1, d2, d3, location = _unpack(SERVER_HEADER, buf, "server")
        return ServerMeta(_as_enum(ServerReturnCode, code, "return code"),
                          _meta_from_fields(length, fmt, dtype, (d0, d1, d2, d3)),
                          _as_enum(Location, location, "location"))


SUCCESS_REPLY = ServerMeta(ServerReturnCode.SUCCESS)
FAIL_REPLY = ServerMeta(ServerReturnCode.FAIL)


def send_payload(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """Sends `data` in pieces, so a socket timeout bounds each piece's progress, not the total
    (CPython's `sendall` applies the timeout to the whole call)."""
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, SEND_CHUNK_BYTES):
        sock.sendall(view[start:start + SEND_CHUNK_BYTES])
