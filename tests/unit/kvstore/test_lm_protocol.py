"""The `lm://` codec: layouts written out field by field from LMCache 0.5.6's struct formats
(`lmcache/v1/protocol.py`), round trips, and malformed input. A header's length/fmt/dtype/shape
are a one-group `kvstore.lmcache_format.RemoteMetadata` (tested in test_lmcache_format.py).
Byte equality with the real package is proven in tests/integration/kvstore/test_lm_compat.py."""

from __future__ import annotations

import struct

import pytest

from kvstore.lm_protocol import (
    CLIENT_HEADER_BYTES,
    MAX_KEY_LENGTH,
    SERVER_HEADER_BYTES,
    ClientCommand,
    ClientMeta,
    Location,
    ServerMeta,
    ServerReturnCode,
    binary_meta,
    check_payload,
    peek_command_and_length,
)
from kvstore.lmcache_format import MemoryFormat, RemoteMetadata

KEY = "llama@1@0@1f2e3d@half"


def _header(*ints: int, key: bytes = KEY.encode()) -> bytes:
    """A client header packed by hand, the key space-padded as LMCache's `str.ljust` does."""
    return struct.pack("<9i150s", *ints, key.ljust(MAX_KEY_LENGTH))


def test_header_sizes_match_lmcache_struct_formats() -> None:
    assert CLIENT_HEADER_BYTES == struct.calcsize(f"iiiiiiiii{MAX_KEY_LENGTH}s") == 186
    assert SERVER_HEADER_BYTES == struct.calcsize("iiiiiiiii") == 36


def test_client_header_fields_are_in_lmcache_order_with_space_padded_key() -> None:
    meta = RemoteMetadata.single((2, 3, 16, 64), "float32", MemoryFormat.KV_2LTD)
    raw = ClientMeta(ClientCommand.PUT, KEY, meta).encode()
    ints = struct.unpack_from("<9i", raw)
    # command, length, fmt, dtype, location, shape0..3
    assert ints == (1, 24576, 1, 4, 0, 2, 3, 16, 64)
    assert raw[36:] == KEY.encode() + b" " * (MAX_KEY_LENGTH - len(KEY))


def test_server_header_puts_location_last() -> None:
    meta = RemoteMetadata.single((256, 2, 576), "bfloat16", MemoryFormat.KV_T2D)
    raw = ServerMeta(ServerReturnCode.SUCCESS, meta, Location.LOCAL_CPU).encode()
    # code, length, fmt, dtype, shape0..3, location
    assert struct.unpack("<9i", raw) == (200, 256 * 2 * 576 * 2, 2, 3, 256, 2, 576, 0, 1)


def test_get_and_exist_defaults_are_lmcaches_placeholder_fields() -> None:
    raw = ClientMeta(ClientCommand.GET, KEY).encode()
    assert struct.unpack_from("<9i", raw) == (2, 0, 1, 2, 0, 0, 0, 0, 0)  # fmt 1, float16, zeros
    assert struct.unpack("<9i", ServerMeta(ServerReturnCode.FAIL).encode()) == (400, 0, 1, 2, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("command", list(ClientCommand))
def test_client_meta_round_trips(command: ClientCommand) -> None:
    meta = RemoteMetadata(123, ((2, 4, 8, 9),), ("float16",), MemoryFormat.KV_2LTD)
    msg = ClientMeta(command, KEY + "@7", meta, Location.LOCAL_DISK)
    assert ClientMeta.decode(msg.encode()) == msg


def test_key_of_exactly_150_bytes_round_trips_and_151_is_refused() -> None:
    key = "m" * (MAX_KEY_LENGTH - len("@1@0@ab@half")) + "@1@0@ab@half"
    assert ClientMeta.decode(ClientMeta(ClientCommand.GET, key).encode()).key == key
    with pytest.raises(ValueError, match="more than LMCache's 150"):
        ClientMeta(ClientCommand.GET, "x" + key)


def test_multibyte_key_is_limited_by_bytes_not_characters() -> None:
    with pytest.raises(ValueError, match="bytes"):
        ClientMeta(ClientCommand.GET, "é" * 100)


def test_server_meta_round_trips() -> None:
    msg = ServerMeta(ServerReturnCode.SUCCESS, binary_meta(99))
    assert ServerMeta.decode(msg.encode()) == msg
    assert msg.length == 99


def test_header_shape_is_padded_on_the_wire_and_stripped_on_decode_except_for_binary() -> None:
    t2d = RemoteMetadata.single((256, 2, 576), "float16", MemoryFormat.KV_T2D)
    raw = ServerMeta(ServerReturnCode.SUCCESS, t2d).encode()
    assert struct.unpack_from("<4i", raw, 16) == (256, 2, 576, 0)
    assert ServerMeta.decode(raw).meta.shapes == ((256, 2, 576),)
    assert ServerMeta.decode(ServerMeta(ServerReturnCode.FAIL).encode()).meta.shapes == ((0,),)
    blob = ServerMeta.decode(ServerMeta(ServerReturnCode.SUCCESS, binary_meta(40)).encode())
    assert blob.meta.shapes == ((40, 0, 0, 0),)  # BINARY: the zeros are part of the shape


def test_header_dtype_codes_are_lmcaches() -> None:
    meta = RemoteMetadata.single((1,), "half", MemoryFormat.KV_2LTD)
    raw = ClientMeta(ClientCommand.PUT, KEY, meta).encode()
    assert struct.unpack_from("<i", raw, 12) == (2,)  # LMCache writes float16 as 2
    half = bytearray(raw)
    half[12:16] = struct.pack("<i", 1)  # torch.half's code: read as float16 too
    assert ClientMeta.decode(half).meta.dtypes == ("float16",)
    assert struct.unpack_from("<5i", ClientMeta(ClientCommand.PUT, KEY, binary_meta(5)).encode(), 4) \
        == (5, 4, 6, 0, 5)  # length, BINARY, uint8, location, [5, 0, 0, 0]


def test_check_payload_sizes_tensor_payloads_and_leaves_binary_ones_unsized() -> None:
    check_payload(RemoteMetadata.single((16, 2, 576), "bfloat16", MemoryFormat.KV_T2D))
    with pytest.raises(ValueError, match="payload is 10"):
        check_payload(RemoteMetadata(10, ((16, 2, 576),), ("bfloat16",), MemoryFormat.KV_T2D))
    check_payload(RemoteMetadata(3, ((7, 0, 0, 0),), ("uint8",), MemoryFormat.BINARY))  # unsized


def test_headers_carry_exactly_one_metadata_group() -> None:
    two = RemoteMetadata(8, ((1, 1, 1, 1), (2, 1, 1, 1)), ("float32", "bfloat16"), MemoryFormat.KV_2LTD)
    with pytest.raises(ValueError, match="one RemoteMetadata group, got 2"):
        ClientMeta(ClientCommand.PUT, KEY, two)
    with pytest.raises(ValueError, match="one RemoteMetadata group, got 2"):
        ServerMeta(ServerReturnCode.SUCCESS, two)
    with pytest.raises(ValueError, match="one RemoteMetadata group, got 2"):
        check_payload(two)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00" * 185, "client header must be 186 bytes"),
        (_header(9, 0, 1, 2, 0, 0, 0, 0, 0), "unknown command 9"),
        (_header(1, -5, 1, 2, 0, 0, 0, 0, 0), "length and dims must fit a non-negative int32, got -5"),
        (_header(2, 0, 42, 2, 0, 0, 0, 0, 0), "unknown LMCache MemoryFormat 42"),
        (_header(2, 0, 1, 77, 0, 0, 0, 0, 0), "unknown LMCache dtype code 77"),
        (_header(2, 0, 1, 2, 5, 0, 0, 0, 0), "unknown location 5"),
        (_header(2, 0, 1, 2, 0, -1, 0, 0, 0), "length and dims must fit a non-negative int32, got -1"),
        (_header(2, 0, 1, 2, 0, 0, 0, 0, 0, key=b""), "non-empty"),
        (_header(2, 0, 1, 2, 0, 0, 0, 0, 0, key=b"\xff\xfe"), "not UTF-8"),
        (struct.pack("<9i150s", 2, 0, 1, 2, 0, 0, 0, 0, 0, b"k@1@0@0@half"), "NUL"),  # NUL-padded
    ],
)
def test_malformed_client_header_raises_value_error(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClientMeta.decode(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00" * 37, "server header must be 36 bytes"),
        (struct.pack("<9i", 201, 0, 1, 2, 0, 0, 0, 0, 0), "unknown return code 201"),
        (struct.pack("<9i", 200, 0, 1, 2, 0, 0, 0, 0, 3), "unknown location 3"),
    ],
)
def test_malformed_server_header_raises_value_error(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerMeta.decode(raw)


def test_peek_reads_command_and_length_of_a_rejected_header() -> None:
    raw = _header(1, 4096, 1, 99, 0, 0, 0, 0, 0)
    assert peek_command_and_length(raw) == (1, 4096)
