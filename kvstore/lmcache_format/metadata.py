"""LMCache 0.5.6 `RemoteMetadata` (`lmcache/v1/protocol.py`): the header stored beside a payload
(its Redis layout keeps it under `key + "metadata"`, the payload under `key + "kv_bytes"`).

Layout, all int32 (native order in LMCache; little-endian on every host we run on):

    length, fmt, then per KV group: dtype_code, dim0, dim1, dim2, dim3

`length` is the payload's byte count; shapes of fewer than 4 dims are padded with trailing
zeros, which `unpack` strips again (keeping at least one dim) except for the BINARY formats,
whose zeros are part of the shape. One group (28 bytes) is the common case.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.lmcache_format.dtypes import DTypeLike, code_dtype, dtype_code, dtype_name
from kvstore.lmcache_format.layouts import MemoryFormat, payload_nbytes

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_UNSTRIPPED_FORMATS = (MemoryFormat.BINARY, MemoryFormat.BINARY_BUFFER)

Shape = tuple[int, ...]


def metadata_nbytes(num_groups: int = 1) -> int:
    """Size of a packed RemoteMetadata with `num_groups` groups (LMCache REMOTE_METADATA_BYTES)."""
    return 4 * (2 + 5 * num_groups)


@dataclass(frozen=True)
class RemoteMetadata:
    length: int
    shapes: tuple[Shape, ...]
    dtypes: tuple[str | None, ...]  # canonical names; None for a binary payload
    fmt: MemoryFormat

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(d) for d in shape) for shape in self.shapes)
        dtypes = tuple(None if d is None else dtype_name(d) for d in self.dtypes)
        if not shapes or len(shapes) != len(dtypes):
            raise ValueError(f"need one dtype per shape and at least one group, got {len(shapes)} shapes "
                             f"and {len(dtypes)} dtypes")
        for shape in shapes:
            if not 1 <= len(shape) <= 4:
                raise ValueError(f"shape {shape} must have 1..4 dims")
        for value in (self.length, *(d for shape in shapes for d in shape)):
            if not 0 <= value <= _INT32_MAX:
                raise ValueError(f"length and dims must fit a non-negative int32, got {value}")
        for d in dtypes:
            dtype_code(d)  # raises for dtypes LMCache cannot encode
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        object.__setattr__(self, "fmt", MemoryFormat(self.fmt))

    @classmethod
    def single(cls, shape: Sequence[int], dtype: DTypeLike, fmt: MemoryFormat) -> RemoteMetadata:
        """Header of one C-contiguous tensor; `length` is its byte count."""
        return cls(payload_nbytes(shape, dtype), (tuple(shape),), (dtype_name(dtype),), fmt)

    @property
    def num_groups(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        return metadata_nbytes(self.num_groups)

    def pack(self) -> bytes:
        return struct.pack(f"<{len(self._values())}i", *self._values())

    def pack_into(self, buffer: Any, offset: int = 0) -> None:
        struct.pack_into(f"<{len(self._values())}i", buffer, offset, *self._values())

    @classmethod
    def unpack(cls, data: Any, num_groups: int | None = None) -> RemoteMetadata:
        """Parses packed bytes (bytes, memoryview, pyarrow.Buffer). The size must be exactly one
        RemoteMetadata (of `num_groups` groups when given); ValueError says what is wrong."""
        size = memoryview(data).nbytes
        if num_groups is not None and size != metadata_nbytes(num_groups):
            raise ValueError(f"RemoteMetadata of {num_groups} group(s) is {metadata_nbytes(num_groups)} "
                             f"bytes, got {size}")
        if size < metadata_nbytes(1) or (size - 8) % 20:
            raise ValueError(f"RemoteMetadata must be 8 + 20 * groups bytes (28 for one group), got {size}")
        values = struct.unpack(f"<{size // 4}i", data)
        if values[1] not in MemoryFormat._value2member_map_:
            raise ValueError(f"unknown LMCache MemoryFormat {values[1]} (known: 0..{len(MemoryFormat) - 1})")
        fmt = MemoryFormat(values[1])
        groups = [values[i:i + 5] for i in range(2, len(values), 5)]
        shapes = tuple(_strip_padding(list(g[1:]), fmt) for g in groups)
        return cls(values[0], shapes, tuple(code_dtype(g[0]) for g in groups), fmt)

    def _values(self) -> list[int]:
        values = [self.length, int(self.fmt)]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            values += [dtype_code(dtype), *shape, *[0] * (4 - len(shape))]
        return values


def _strip_padding(dims: list[int], fmt: MemoryFormat) -> Shape:
    if fmt in _UNSTRIPPED_FORMATS:
        return tuple(dims)
    end = len(dims)
    while end > 1 and dims[end - 1] == 0:
        end -= 1
    return tuple(dims[:end])
