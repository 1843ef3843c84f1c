"""The KV store server: Arrow Flight data plane (DoPut / DoGet of whole objects) and control
actions (protos/kvstore.proto) over a memory or Redis backend.

Guarantees: an object becomes visible only after its whole record batch arrived and passed the
checks (key format, LMCache metadata of the right size, size limits), so a client that
disconnects mid-put leaves nothing partial behind; every bad request gets an error naming what
is wrong (gRPC INVALID_ARGUMENT through pyarrow's ArrowInvalid) and the server keeps serving.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from kvstore.assembler import PartAssembler
from kvstore.auth import MIDDLEWARE_KEY, TokenAuthFactory, check_role
from kvstore.backend import Backend, KVObject, KVStoreError
from kvstore.chunked import ChunkedPayload
from kvstore.credentials import TLSFiles
from kvstore.metrics import StoreMetrics
from kvstore.shm import ShmArea, ShmFile
from kvstore.validation import check_checksum, check_key, check_metadata
from kvstore.wire import SCHEMA, as_buffer, iter_objects, object_batch
from protos import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

MAX_KEYS_PER_CALL = 100_000


class KVStoreServer(flight.FlightServerBase):
    """`KVStoreServer(backend, location="grpc://127.0.0.1:0")`; `.port` is the bound port.
    `validate` checks keys are LMCache key strings and metadata is LMCache `RemoteMetadata`
    whose length matches the payload (on by default; off for opaque objects).
    `tokens` (token -> roles, kvstore/auth.py) makes every call present a token; None = open.
    `tls` (cert + key, and `ca` for mutual TLS) serves a `grpc+tls://` location."""

    def __init__(self, backend: Backend, location: str = "grpc://127.0.0.1:0",
                 max_object_bytes: int | None = None, validate: bool = True,
                 default_ttl_s: float | None = None, shm_root: str | None = None,
                 tokens: dict[str, frozenset[str]] | None = None,
                 tls: TLSFiles | None = None) -> None:
        # Every attribute a handler reads is set before the base class's __init__, which starts
        # serving at once: a client that saw the port (a health check, say) could otherwise be
        # answered by a half-built server ("no attribute 'shm'", seen once under make test).
        self.auth_enabled = tokens is not None
        self.instance_id = os.environ.get("PDSERVE_INSTANCE_ID") or uuid.uuid4().hex
        self.backend = backend
        self.max_object_bytes = max_object_bytes
        self.validate = validate
        self.default_ttl_s = default_ttl_s
        self.metrics = StoreMetrics()
        capacity = backend.stats().capacity_bytes
        self.assembler = PartAssembler(max_pending_bytes=capacity or 8 * 2**30)
        self._actions: dict[str, Callable[[bytes], bytes]] = {
            "lookup": self._lookup, "exists": self._exists, "delete": self._delete,
            "lease": self._lease, "release": self._release, "pin": self._pin,
            "unpin": self._unpin, "stats": self._stats, "health": self._health,
            "metrics": self._metrics, "shm_info": self._shm_info, "shm_put": self._shm_put,
            "shm_get": self._shm_get,
        }
        # Same-host data path (kvstore/shm.py): a directory under `shm_root`, or none.
        self.shm = ShmArea(shm_root) if shm_root else None
        try:
            super().__init__(location, middleware={MIDDLEWARE_KEY: TokenAuthFactory(tokens)}
                             if tokens is not None else None, **_tls_options(tls))
        except BaseException:
            self.close_shm()  # the port was taken (say): no directory left behind
            raise

    def close_shm(self) -> None:
        """Removes the shared-memory directory (after `shutdown`)."""
        if self.shm is not None:
            self.shm.close()

    # --- data plane -------------------------------------------------------------------
    def do_put(self, context: Any, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: Any) -> None:
        check_role(context, "put", self.auth_enabled)  # before a single byte is read
        start = time.perf_counter()
        try:
            ttl = self._put_ttl(descriptor)
            if not reader.schema.equals(SCHEMA):
                raise pa.ArrowInvalid(f"put: schema must be {SCHEMA}, got {reader.schema}")
            for chunk in reader:
                batch = chunk.data
                if batch is None:
                    continue
                for row in iter_objects(batch):
                    if row.is_whole:
                        self._store(row.key, row.metadata, row.data, ttl, row.checksum)
                        continue
                    if self.validate:
                        check_key(row.key)
                    check_checksum(row.key, row.checksum)
                    self._check_size(row.key, len(row.metadata) + row.total)
                    done = self.assembler.add(row.key, row.metadata, row.offset, row.total, row.data,
                                              row.checksum)
                    if done is not None:
                        self._store(row.key, done[0], done[1], ttl, done[2])
        except KVStoreError as exc:
            self.metrics.errors.labels("put").inc()
            raise pa.ArrowInvalid(str(exc)) from exc
        except pa.ArrowInvalid:
            self.metrics.errors.labels("put").inc()
            raise
        finally:
            self.metrics.put_latency.observe(time.perf_counter() - start)

    def _put_ttl(self, descriptor: flight.FlightDescriptor) -> float | None:
        if descriptor.descriptor_type != flight.DescriptorType.CMD:
            raise pa.ArrowInvalid("put: the descriptor must be a command holding a PutRequest")
        req = _parse(pb.PutRequest, descriptor.command, "put")
        if req.ttl_s < 0:
            raise pa.ArrowInvalid(f"put: ttl_s must be >= 0, got {req.ttl_s}")
        return req.ttl_s or self.default_ttl_s

    def _store(self, key: str, meta: bytes, payload: pa.Buffer | ChunkedPayload | ShmFile,
               ttl: float | None, checksum: bytes = b"") -> None:
        if self.validate:
            check_key(key)
            check_metadata(key, meta, payload.size)
        elif not key:
            raise pa.ArrowInvalid("put: key must not be empty")
        check_checksum(key, checksum)
        self._check_size(key, len(meta) + payload.size)
        self.backend.put(key, KVObject(meta, payload, checksum), ttl)
        self.metrics.put_objects.inc()
        self.metrics.put_bytes.inc(payload.size)

    def _check_size(self, key: str, size: int) -> None:
        if self.max_object_bytes is not None and size > self.max_object_bytes:
            raise pa.ArrowInvalid(f"put {key!r}: object of {size} bytes is over max_object_bytes "
                                  f"{self.max_object_bytes}")

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        check_role(context, "get", self.auth_enabled)
        start = time.perf_counter()
        req = _parse(pb.GetRequest, ticket.ticket, "get")
        keys = list(req.keys)
        _check_keys(keys, "get")
        try:
            batches = [b for key in keys for b in _batches(key, self.backend.get(key), req.offset,
                                                            req.length)]
        except KVStoreError as exc:  # e.g. the Redis holding the key is down: the client's miss
            self.metrics.errors.labels("get").inc()
            raise pa.ArrowInvalid(str(exc)) from exc
        self.metrics.get_bytes.inc(sum(b.column(2).buffers()[2].size for b in batches
                                       if b.column(2).buffers()[2] is not None))
        self.metrics.get_latency.observe(time.perf_counter() - start)
        return flight.GeneratorStream(SCHEMA, iter(batches))

    # --- control plane ----------------------------------------------------------------
    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        check_role(context, "list_actions", self.auth_enabled)
        return [(name, f"see protos/kvstore.proto: {name}") for name in self._actions]

    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        handler = self._actions.get(action.type)
        if handler is None:
            self.metrics.errors.labels("action").inc()
            raise pa.ArrowInvalid(f"unknown action {action.type!r}; known: {sorted(self._actions)}")
        check_role(context, action.type, self.auth_enabled)
        body = action.body.to_pybytes() if action.body is not None else b""
        try:
            yield handler(body)
        except KVStoreError as exc:
            self.metrics.errors.labels(action.type).inc()
            raise pa.ArrowInvalid(str(exc)) from exc
        except pa.ArrowInvalid:
            self.metrics.errors.labels(action.type).inc()
            raise

    def _keys(self, body: bytes, op: str) -> list[str]:
        keys = list(_parse(pb.KeysRequest, body, op).keys)
        _check_keys(keys, op)
        return keys

    def _lookup(self, body: bytes) -> bytes:
        keys = list(_parse(pb.LookupRequest, body, "lookup").keys)
        _check_keys(keys, "lookup")
        present = self.backend.exists(keys)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return pb.LookupResponse(prefix_len=prefix, present=present).SerializeToString()

    def _exists(self, body: bytes) -> bytes:
        present = self.backend.exists(self._keys(body, "exists"))
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return pb.LookupResponse(prefix_len=prefix, present=present).SerializeToString()

    def _delete(self, body: bytes) -> bytes:
        return _count(self.backend.delete(self._keys(body, "delete")))

    def _lease(self, body: bytes) -> bytes:
        req = _parse(pb.KeysRequest, body, "lease")
        if not req.ttl_s > 0:
            raise pa.ArrowInvalid(f"lease: ttl_s must be > 0, got {req.ttl_s}")
        _check_keys(list(req.keys), "lease")
        return _count(self.backend.lease(list(req.keys), req.ttl_s))

    def _release(self, body: bytes) -> bytes:
        return _count(self.backend.release(self._keys(body, "release")))

    def _pin(self, body: bytes) -> bytes:
        return _count(self.backend.pin(self._keys(body, "pin")))

    def _unpin(self, body: bytes) -> bytes:
        return _count(self.backend.unpin(self._keys(body, "unpin")))

    def _stats(self, body: bytes) -> bytes:
        s = self.backend.stats()
        return pb.StatsResponse(
            backend=self.backend.name, objects=s.objects, bytes_used=s.bytes_used,
            capacity_bytes=s.capacity_bytes, hits=s.hits, misses=s.misses, evictions=s.evictions,
            leased=s.leased, pinned=s.pinned, max_object_bytes=self.max_object_bytes or 0,
        ).SerializeToString()

    def _health(self, body: bytes) -> bytes:
        try:
            self.backend.probe()
            status = "SERVING"
        except Exception as exc:
            logger.warning("health probe failed: %s", exc)
            status = "NOT_SERVING"
        return pb.HealthResponse(status=status, backend=self.backend.name,
                                 instance_id=self.instance_id).SerializeToString()

    def _metrics(self, body: bytes) -> bytes:
        return self.metrics.exposition(self.backend.stats())

    # --- same-host data path ------------------------------------------------------------
    def _shm_info(self, body: bytes) -> bytes:
        if self.shm is None:
            return pb.ShmInfo().SerializeToString()
        return pb.ShmInfo(dir=self.shm.dir, token=self.shm.token).SerializeToString()

    def _shm_area(self, op: str) -> ShmArea:
        if self.shm is None:
            raise pa.ArrowInvalid(f"{op}: this store has no shared-memory directory "
                                  f"(started with --shm-dir off); use DoGet / DoPut")
        return self.shm

    def _shm_put(self, body: bytes) -> bytes:
        start = time.perf_counter()
        area = self._shm_area("shm_put")
        req = _parse(pb.ShmPutRequest, body, "shm_put")
        objects = list(req.objects)
        try:
            if req.ttl_s < 0:
                raise pa.ArrowInvalid(f"shm_put: ttl_s must be >= 0, got {req.ttl_s}")
            if len(objects) > MAX_KEYS_PER_CALL:
                raise pa.ArrowInvalid(f"shm_put: {len(objects)} objects in one call, at most "
                                      f"{MAX_KEYS_PER_CALL}")
            ttl = req.ttl_s or self.default_ttl_s
            stored = 0
            for obj in objects:
                # Adopted, the file is the store's: dropped (even by a failing check) = deleted.
                self._store(obj.key, obj.metadata, area.adopt(obj.file, obj.size), ttl, obj.checksum)
                self.metrics.shm_put_objects.inc()
                stored += 1
            return _count(stored)
        finally:
            for obj in objects:  # those not adopted (after a failure): nobody else will
                area.discard(obj.file)
            area.sweep()
            self.metrics.put_latency.observe(time.perf_counter() - start)

    def _shm_get(self, body: bytes) -> bytes:
        start = time.perf_counter()
        self._shm_area("shm_get")
        out = pb.ShmGetResponse()
        nbytes = 0
        for key in self._keys(body, "shm_get"):
            obj = self.backend.get(key)
            if obj is None:
                out.objects.add(key=key, found=False)
            elif isinstance(obj.data, ShmFile):
                out.objects.add(key=key, found=True, metadata=obj.metadata, file=obj.data.name,
                                size=obj.data.size, checksum=obj.checksum)
                nbytes += obj.data.size
                self.metrics.shm_get_objects.inc()
            else:  # put over Flight, or a backend outside this process: DoGet
                out.objects.add(key=key, found=True, metadata=obj.metadata, size=len(obj.data),
                                checksum=obj.checksum)
        self.metrics.get_bytes.inc(nbytes)
        self.metrics.get_latency.observe(time.perf_counter() - start)
        return out.SerializeToString()


def _tls_options(tls: TLSFiles | None) -> dict[str, Any]:
    """FlightServerBase's TLS arguments: the server's certificate and key, and with a client
    CA, mutual TLS (clients must present a certificate that CA signed)."""
    if tls is None:
        return {}
    if tls.cert is None or tls.key is None:
        raise ValueError("TLS: the server needs --tls-cert and --tls-key")
    options: dict[str, Any] = {"tls_certificates": [(_read_pem(tls.cert), _read_pem(tls.key))]}
    if tls.ca is not None:
        options.update(verify_client=True, root_certificates=_read_pem(tls.ca))
    return options


def _read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _batches(key: str, obj: KVObject | None, offset: int, length: int) -> list[pa.RecordBatch]:
    """The object, or its byte range [offset, offset + length) (length 0 = to the end): one
    row, or one row per stored part the range covers (each with its offset; zero-copy)."""
    if obj is None:
        return [object_batch(key, b"", b"", found=False, total=0)]
    if isinstance(obj.data, ShmFile):
        obj = KVObject(obj.metadata, obj.data.contiguous(), obj.checksum)
    if isinstance(obj.data, ChunkedPayload):
        size = obj.data.size
        start = min(offset, size)
        end = size if length == 0 else min(size, start + length)
        pieces = obj.data.pieces(start, end) or [(start, pa.py_buffer(b""))]
        return [object_batch(key, obj.metadata, piece, offset=at, total=size, checksum=obj.checksum)
                for at, piece in pieces]
    data = as_buffer(obj.data)
    if offset == 0 and (length == 0 or length >= data.size):
        return [object_batch(key, obj.metadata, data, checksum=obj.checksum)]
    start = min(offset, data.size)
    end = data.size if length == 0 else min(data.size, start + length)
    return [object_batch(key, obj.metadata, data.slice(start, end - start), offset=start,
                         total=data.size, checksum=obj.checksum)]


def _parse(message_type: Any, body: bytes, op: str) -> Any:
    msg = message_type()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise pa.ArrowInvalid(f"{op}: body is not a {message_type.__name__}: {exc}") from exc
    return msg


def _check_keys(keys: list[str], op: str) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise pa.ArrowInvalid(f"{op}: {len(keys)} keys in one call, at most {MAX_KEYS_PER_CALL}")
    if any(not k for k in keys):
        raise pa.ArrowInvalid(f"{op}: keys must not be empty strings")


def _count(n: int) -> bytes:
    return pb.CountResponse(count=n).SerializeToString()
