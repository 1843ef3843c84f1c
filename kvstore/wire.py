"""Arrow layout of objects on the Flight data plane, built and read without copying payloads.

Every record batch has the columns key (utf8), metadata (binary), data (large_binary), found
(bool), offset and total (uint64: where `data` sits in an object of `total` bytes; a whole object
has offset 0 and total = len(data)) and checksum (binary: the producer's checksum of the whole
object, kvstore/integrity.py; empty = none; every part of an object carries it). A put sends
and a get returns one batch per object (or per part of a large object), so a payload travels as
one Arrow buffer laid over the caller's memory (a tensor, bytes, or a buffer the server holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([
    pa.field("key", pa.utf8(), nullable=False),
    pa.field("metadata", pa.binary(), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
    pa.field("found", pa.bool_(), nullable=False),
    pa.field("offset", pa.uint64(), nullable=False),
    pa.field("total", pa.uint64(), nullable=False),
    pa.field("checksum", pa.binary(), nullable=False),
])


def as_buffer(data: Any) -> pa.Buffer:
    """A pyarrow.Buffer over `data` (pa.Buffer, bytes, bytearray, memoryview, numpy array),
    without copying."""
    if isinstance(data, pa.Buffer):
        return data
    if isinstance(data, np.ndarray):
        return pa.py_buffer(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    return pa.py_buffer(data)


def object_batch(key: str, metadata: bytes, data: Any, found: bool = True, offset: int = 0,
                 total: int | None = None, checksum: bytes = b"") -> pa.RecordBatch:
    """One object (or the part at `offset` of an object of `total` bytes) as a one-row batch;
    the payload buffer is referenced, not copied."""
    payload = as_buffer(data)
    total = payload.size if total is None else total
    offsets = pa.py_buffer(np.array([0, payload.size], dtype=np.int64))
    data_arr = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, payload])
    return pa.RecordBatch.from_arrays(
        [pa.array([key], pa.utf8()), pa.array([metadata], pa.binary()), data_arr,
         pa.array([found], pa.bool_()), pa.array([offset], pa.uint64()),
         pa.array([total], pa.uint64()), pa.array([checksum], pa.binary())], schema=SCHEMA)


class Row(NamedTuple):
    key: str
    metadata: bytes
    data: pa.Buffer
    found: bool
    offset: int
    total: int
    checksum: bytes = b""

    @property
    def is_whole(self) -> bool:
        return self.offset == 0 and self.total == self.data.size


def iter_objects(batch: pa.RecordBatch) -> Iterator[Row]:
    """The rows of a batch; payloads are zero-copy slices of the batch's data buffer."""
    if not batch.schema.equals(SCHEMA):
        raise ValueError(f"record batch schema must be {SCHEMA}, got {batch.schema}")
    keys = batch.column(0).to_pylist()
    metas = batch.column(1).to_pylist()
    found = batch.column(3).to_pylist()
    offs = batch.column(4).to_pylist()
    totals = batch.column(5).to_pylist()
    sums = batch.column(6).to_pylist()
    data = batch.column(2)
    _, offsets_buf, values = data.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[data.offset: data.offset + len(data) + 1]
    for i, key in enumerate(keys):
        start, end = int(offsets[i]), int(offsets[i + 1])
        payload = values.slice(start, end - start) if values is not None else pa.py_buffer(b"")
        yield Row(key, metas[i], payload, bool(found[i]), int(offs[i]), int(totals[i]), sums[i])
