"""The KV store client's Flight data path (used by kvstore/client.py and kvstore/shm_client.py):
puts that cut large objects into parts over parallel streams, gets that read the head of every
object in one call and the rest of large ones in byte ranges over parallel streams, and the
helpers that lay received pieces into one buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from kvstore.link import KVStoreClientError, StoreLink
from kvstore.wire import SCHEMA, Row, as_buffer, iter_objects, object_batch
from protos import kvstore_pb2 as pb

# (key, metadata, payload) or (key, metadata, payload, checksum); see KVStoreClient.put
PutItem = tuple[str, bytes, Any] | tuple[str, bytes, Any, bytes]
# What `fetch` answers per found key: (metadata, size, pieces in the order received)
Fetched = tuple[bytes, int, list[Row]]


def put(link: StoreLink, items: Sequence[PutItem], ttl_s: float | None,
        split_put_bytes: int) -> None:
    """Sends `items` over Flight: objects of at least `split_put_bytes` in `link.streams` parts,
    one per parallel stream; the smaller ones whole on the first stream."""
    command = pb.PutRequest(ttl_s=ttl_s or 0.0).SerializeToString()
    descriptor = flight.FlightDescriptor.for_command(command)

    def send(batches: list[pa.RecordBatch]) -> Callable[[flight.FlightClient], None]:
        def run(conn: flight.FlightClient) -> None:
            writer, _ = conn.do_put(descriptor, SCHEMA, options=link.options())
            try:
                for batch in batches:
                    writer.write_batch(batch)
            finally:
                writer.close()
        return run

    lanes = _put_lanes(items, link.streams, split_put_bytes)
    link.parallel("put", [send(b) for b in lanes if b])


def _put_lanes(items: Sequence[PutItem], streams: int, split_put_bytes: int
               ) -> list[list[pa.RecordBatch]]:
    """The record batches each of `streams` parallel puts sends."""
    lanes: list[list[pa.RecordBatch]] = [[] for _ in range(streams)]
    small: list[pa.RecordBatch] = []
    for key, meta, data, checksum in put_items(items):
        buf = as_buffer(data)
        if buf.size < split_put_bytes or streams == 1:
            small.append(object_batch(key, meta, buf, checksum=checksum))
            continue
        step = -(-buf.size // streams)
        for lane, off in enumerate(range(0, buf.size, step)):
            part = buf.slice(off, min(step, buf.size - off))
            lanes[lane].append(object_batch(key, meta, part, offset=off, total=buf.size,
                                            checksum=checksum))
    if small:
        lanes[0] = small + lanes[0]
    return lanes


def fetch(link: StoreLink, keys: Sequence[str], parallel_bytes: int) -> list[Fetched | None]:
    """Per key: (metadata, size, pieces) or None. The first read takes up to
    `parallel_bytes * streams` of each object (one round trip for most objects); what is
    left of larger ones is fetched in byte ranges over parallel streams. The server answers
    a range with one row, or one per part it stored the object in."""
    streams = link.streams
    head = parallel_bytes * streams
    first = link.call("get", lambda c: _read(link, c, pb.GetRequest(keys=list(keys), length=head)))
    rows = iter(first)
    out: list[Fetched | None] = []
    for key in keys:
        row = next(rows, None)
        if row is None or row.key != key:
            raise KVStoreClientError(f"get: the answer for {key!r} is missing or out of order")
        if not row.found:
            out.append(None)
            continue
        pieces = [row, *_rest_of_range(rows, key, row, 0, min(head, row.total))]
        got = sum(p.data.size for p in pieces)
        if got < row.total:
            step = -(-(row.total - got) // streams)
            starts = list(range(got, row.total, step))
            tasks = [_range_task(link, key, o, min(step, row.total - o)) for o in starts]
            for o, answer in zip(starts, link.parallel("get", tasks), strict=True):
                it = iter(answer)
                lead = next(it, None)
                if lead is None or not lead.found or lead.total != row.total:
                    raise KVStoreClientError(f"get {key!r}: the object changed or vanished "
                                             f"while it was read")
                pieces += [lead, *_rest_of_range(it, key, lead, o, min(o + step, row.total))]
        out.append((row.metadata, row.total, pieces))
    return out


def _read(link: StoreLink, conn: flight.FlightClient, req: Any) -> list[Row]:
    reader = conn.do_get(flight.Ticket(req.SerializeToString()), options=link.options())
    return [row for chunk in reader for row in iter_objects(chunk.data)]


def _range_task(link: StoreLink, key: str, offset: int, length: int
                ) -> Callable[[flight.FlightClient], list[Row]]:
    return lambda c: _read(link, c, pb.GetRequest(keys=[key], offset=offset, length=length))


def _rest_of_range(rows: Iterator[Row], key: str, first: Row, start: int, end: int) -> list[Row]:
    """The rows after `first` that complete the range [start, end) of `key`."""
    got, out = first.offset + first.data.size, []
    if first.offset != start:
        raise KVStoreClientError(f"get {key!r}: expected bytes from {start}, got {first.offset}")
    while got < end:
        row = next(rows, None)
        if row is None or row.key != key or row.offset != got or row.total != first.total:
            raise KVStoreClientError(f"get {key!r}: the answer stops at byte {got} of {end}")
        out.append(row)
        got += row.data.size
    return out


def put_items(items: Sequence[PutItem]) -> Iterator[tuple[str, bytes, Any, bytes]]:
    """Every item as (key, metadata, payload, checksum); b"" for an item without one."""
    for item in items:
        if len(item) == 4:
            yield item
        else:
            key, meta, data = item[:3]
            yield key, meta, data, b""


def copy_pieces(pieces: list[Row], dst: np.ndarray) -> np.ndarray:
    """Lays each received piece at its offset in `dst` (uint8); returns `dst`."""
    for p in pieces:
        dst[p.offset:p.offset + p.data.size] = np.frombuffer(p.data, dtype=np.uint8)
    return dst


def out_bytes(key: str, out: Any, total: int) -> np.ndarray:
    """`out` viewed as `total` writable bytes (ValueError naming the key if it is not)."""
    dst = np.asarray(out).reshape(-1).view(np.uint8)
    if dst.size != total:
        raise ValueError(f"get_into {key!r}: output holds {dst.size} bytes, the object "
                         f"has {total}")
    return dst
