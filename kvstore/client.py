"""Client of the KV store server (used by the KV connector): batched put / get / lookup over
Arrow Flight, control actions, timeouts, and one reconnect-and-retry when the connection broke
(every operation is idempotent: a put replaces, a get reads).

Payloads go out as Arrow buffers laid over the caller's memory (bytes, numpy arrays, tensors
through `kvstore.lmcache_format.tensor_to_buffer`), and `get_into` copies each received payload
once, straight into a caller's preallocated buffer (a numpy array or a tensor's numpy view).

Same host (kvstore/shm.py): when the server has a shared-memory directory this process can
see, puts write each payload once into a file there and send only names, and gets read the
files the server names; objects the server holds outside that directory still come over
Flight, and any trouble with the directory (full, gone after a server restart) falls back to
Flight for that call and asks the server again on the next one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from kvstore import shm
from kvstore.backend import KVObject
from kvstore.connect import StoreCredentials
from kvstore.wire import SCHEMA, Row, as_buffer, iter_objects, object_batch
from protos import kvstore_pb2 as pb

logger = logging.getLogger(__name__)
T = TypeVar("T")
# (key, metadata, payload) or (key, metadata, payload, checksum); see KVStoreClient.put
PutItem = tuple[str, bytes, Any] | tuple[str, bytes, Any, bytes]

DEFAULT_LOCATION = "grpc://127.0.0.1:50071"
# gRPC channel options: a 64 MiB HTTP/2 lookahead lets one stream keep a large object in flight
# (measured on loopback: 8 MB puts ~600 -> ~1,300 MB/s, gets ~1,000 -> ~1,400 MB/s).
CHANNEL_OPTIONS = [("grpc.http2.lookahead_bytes", 64 * 2**20)]
SHM_RETRY_S = 10.0  # after the shared-memory path failed, Flight only for this long
_AUTH_REFUSALS_LOGGED: set[str] = set()  # store locations whose refusal was logged (once each)


class KVStoreClientError(Exception):
    """The server rejected a call (the message says why) or could not be reached."""


class KVStoreRejectedError(KVStoreClientError):
    """The server refused the request itself (bad key, metadata, size...): sending it another
    way would not help."""


class KVStoreAuthError(KVStoreRejectedError):
    """The server refused this client's credential: no or an unknown token (UNAUTHENTICATED),
    or a token without the role the operation needs (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class StoreStats:
    backend: str
    objects: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    leased: int
    pinned: int
    max_object_bytes: int


class KVStoreClient:
    """`timeout_s` bounds every call. With `breaker_s`, a store that was unreachable or timed out
    is not asked again for that long: calls fail at once (KVStoreClientError), so a KV connector
    facing a dead or frozen store recomputes instead of waiting on every call.
    `token` (default $PDSERVE_KV_TOKEN / $PDSERVE_KV_TOKEN_FILE) goes with every call;
    `tls_ca` / `tls_cert` / `tls_key` (default $PDSERVE_KV_TLS_CA / _CERT / _KEY) serve a
    grpc+tls:// location (kvstore/connect.py)."""

    def __init__(self, location: str = DEFAULT_LOCATION, timeout_s: float = 30.0,
                 streams: int = 4, parallel_bytes: int = 2 * 2**20,
                 split_put_bytes: int = 16 * 2**20, use_shm: bool = True, breaker_s: float = 0.0,
                 *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.credentials = StoreCredentials.resolve(token, tls_ca, tls_cert, tls_key)
        location = self.credentials.location(location)
        self._headers = self.credentials.headers()
        if streams < 1 or parallel_bytes < 1 or split_put_bytes < 1:
            raise ValueError(f"streams, parallel_bytes and split_put_bytes must be >= 1, got "
                             f"{streams}, {parallel_bytes}, {split_put_bytes}")
        self.location = location
        self.timeout_s = timeout_s
        self.streams = streams
        self.parallel_bytes = parallel_bytes
        self.split_put_bytes = split_put_bytes
        self._client: flight.FlightClient | None = None
        self._pool: list[flight.FlightClient] = []
        self._pool_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.use_shm = use_shm
        self._shm_dir: str | None = None
        self._shm_checked = False
        self._shm_retry_at = 0.0  # after a failure: Flight only until then
        self.breaker_s = breaker_s
        self._down_until = 0.0  # the breaker is open until then
        self._down_reason = ""

    # --- connection -------------------------------------------------------------------
    def _conn(self) -> flight.FlightClient:
        if self._client is None:
            self._client = self.credentials.connect(self.location, CHANNEL_OPTIONS)
        return self._client

    def _options(self, timeout_s: float | None = None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(timeout=timeout_s or self.timeout_s, headers=self._headers)

    def _call(self, op: str, fn: Callable[[flight.FlightClient], T]) -> T:
        """Runs `fn`; on a broken connection reconnects once and retries."""
        left = self._down_until - time.monotonic()
        if left > 0:
            raise KVStoreClientError(f"{op}: KV store at {self.location} unavailable (not asked again "
                                     f"for {left:.1f} s after: {self._down_reason})")
        for attempt in (0, 1):
            try:
                return fn(self._conn())
            except flight.FlightUnavailableError as exc:
                self._reset_connections()
                if attempt == 1:
                    raise self._trip(f"{op}: KV store at {self.location} unavailable: {exc}") from exc
                logger.info("%s: reconnecting to %s", op, self.location)
            except flight.FlightTimedOutError as exc:
                self._reset_connections()  # a frozen server holds the connection: start over
                raise self._trip(f"{op}: timed out after {self.timeout_s} s") from exc
            except pa.ArrowInvalid as exc:
                raise KVStoreRejectedError(f"{op}: {_server_message(exc)}") from exc
            except (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError) as exc:
                raise self._auth_refused(op, exc) from exc
            except (flight.FlightServerError, flight.FlightInternalError) as exc:
                raise KVStoreClientError(f"{op}: {_server_message(exc)}") from exc
        raise AssertionError("unreachable")

    def _auth_refused(self, op: str, exc: Exception) -> KVStoreAuthError:
        """Not a breaker trip (the store is up): every call fails at once with the server's
        reason, which is logged at error level the first time, since a connector recomputes
        quietly on store errors."""
        error = KVStoreAuthError(f"{op}: KV store at {self.location} refused this client: "
                                 f"{_server_message(exc)}")
        if self.location not in _AUTH_REFUSALS_LOGGED:  # probes make a client per call
            _AUTH_REFUSALS_LOGGED.add(self.location)
            logger.error("%s (check PDSERVE_KV_TOKEN and the store's token file)", error)
        return error

    def _trip(self, message: str) -> KVStoreClientError:
        if self.breaker_s > 0:
            self._down_until = time.monotonic() + self.breaker_s
            self._down_reason = message
            logger.warning("%s; not asking the store again for %.0f s", message, self.breaker_s)
        return KVStoreClientError(message)

    def close(self) -> None:
        self._reset_connections()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _reset_connections(self) -> None:
        with self._pool_lock:  # parallel streams take pool channels under it
            conns, self._client, self._pool = [self._client, *self._pool], None, []
        for conn in conns:
            if conn is not None:
                with contextlib.suppress(Exception):  # closing a broken channel may raise
                    conn.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- same-host data path ---------------------------------------------------------
    def shm_dir(self) -> str | None:
        """The server's shared-memory directory when this process sees it, else None (asked
        once; again `SHM_RETRY_S` after a failure, e.g. a full /dev/shm or a restarted server)."""
        if not self.use_shm or time.monotonic() < self._shm_retry_at:
            return None
        if not self._shm_checked:
            try:
                info = self._action("shm_info", pb.Empty(), pb.ShmInfo)
                self._shm_dir = shm.usable_dir(info.dir, info.token)
            except KVStoreClientError as exc:
                if "unknown action" not in str(exc):
                    raise  # unreachable etc.: the caller's Flight call says so
                self._shm_dir = None  # a server without this path
            self._shm_checked = True
        return self._shm_dir

    def _via_shm(self, op: str, fn: Callable[[str], T]) -> T | None:
        """`fn(directory)` through the shared-memory path, or None when this call goes over
        Flight (no directory this process sees, or the path failed: then Flight only for
        SHM_RETRY_S). A request the server refuses as such raises."""
        if not self.use_shm:
            return None
        try:
            directory = self.shm_dir()
            return None if directory is None else fn(directory)
        except KVStoreRejectedError:
            raise
        except (OSError, KVStoreClientError) as exc:
            self._shm_failed(op, exc)
            return None

    def _shm_failed(self, op: str, exc: Exception) -> None:
        logger.info("%s through shared memory failed (%s); using Flight for %.0f s", op, exc,
                    SHM_RETRY_S)
        self._shm_dir, self._shm_checked = None, False
        self._shm_retry_at = time.monotonic() + SHM_RETRY_S

    def _shm_put(self, directory: str, items: Sequence[PutItem], ttl_s: float | None) -> bool:
        req = pb.ShmPutRequest(ttl_s=ttl_s or 0.0)
        try:
            for key, meta, data, checksum in _put_items(items):
                buf = as_buffer(data)
                req.objects.add(key=key, metadata=meta, file=shm.write_file(directory, buf),
                                size=buf.size, checksum=checksum)
            self._action("shm_put", req, pb.CountResponse)
        except BaseException:
            for obj in req.objects:  # the server deletes what it did not adopt; in case it
                shm.discard_file(directory, obj.file)  # never got the call
            raise
        return True

    def _shm_locate(self, keys: Sequence[str]) -> list[Any]:
        """The server's ShmObject per key, checked to answer `keys` in order."""
        resp = self._action("shm_get", pb.KeysRequest(keys=list(keys)), pb.ShmGetResponse)
        if len(resp.objects) != len(keys):
            raise KVStoreClientError(f"shm_get: {len(resp.objects)} answers for {len(keys)} keys")
        for key, obj in zip(keys, resp.objects, strict=True):
            if obj.key != key:
                raise KVStoreClientError(f"shm_get: the answer for {key!r} is out of order")
        return list(resp.objects)

    def _shm_get(self, directory: str, keys: Sequence[str], outs: Sequence[Any] | None = None
                 ) -> list[tuple[bytes, Any, bytes] | None]:
        """Per key (metadata, payload array, checksum) or None; objects outside shared memory
        (or dropped since the server named their file) come over Flight."""
        out: list[tuple[bytes, Any, bytes] | None] = []
        rest: list[int] = []
        for i, (key, obj) in enumerate(zip(keys, self._shm_locate(keys), strict=True)):
            out.append(None)
            if not obj.found:
                continue
            if not obj.file:
                rest.append(i)
                continue
            dst = None if outs is None else _out_bytes(key, outs[i], obj.size)
            try:
                out[i] = (obj.metadata, shm.read_file(directory, obj.file, obj.size, dst),
                          obj.checksum)
            except FileNotFoundError:
                _check_dir(directory)
                rest.append(i)
        if rest:
            for i, fetched in zip(rest, self._fetch([keys[i] for i in rest]), strict=True):
                if fetched is None:
                    continue
                meta, total, pieces = fetched
                dst = (np.empty(total, dtype=np.uint8) if outs is None
                       else _out_bytes(keys[i], outs[i], total))
                out[i] = (meta, _copy_pieces(pieces, dst), pieces[0].checksum)
        return out

    # --- data plane -------------------------------------------------------------------
    def _pool_conn(self, i: int) -> flight.FlightClient:
        """The i-th extra channel for parallel streams (one gRPC stream per channel scales
        better than many streams on one channel)."""
        with self._pool_lock:
            while len(self._pool) <= i:
                self._pool.append(self.credentials.connect(self.location, CHANNEL_OPTIONS))
            return self._pool[i]

    def _parallel(self, op: str, tasks: list[Callable[[flight.FlightClient], T]]) -> list[T]:
        if len(tasks) == 1:
            return [self._call(op, tasks[0])]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.streams, thread_name_prefix="kvstore-client")
        futs = [self._executor.submit(self._call, op, lambda _c, t=t, i=i: t(self._pool_conn(i)))
                for i, t in enumerate(tasks)]
        return [f.result() for f in futs]

    def put(self, items: Sequence[PutItem], ttl_s: float | None = None) -> None:
        """Stores every (key, metadata, payload) or (key, metadata, payload, checksum) (the
        producer's checksum, kvstore/integrity.py; the store keeps it and returns it with the
        object, never checks it); payloads are not copied. Objects of at least
        `split_put_bytes` are cut into parts sent over `streams` parallel streams (the server
        keeps the parts as received, without copying them together; bench_kvstore on loopback:
        8 MB puts ~0.9 GB/s in parts vs ~1.15 GB/s whole, 64 MB ~1.8 vs ~1.1 GB/s); the server stores
        each object only once all of it arrived."""
        if not items:
            return
        if self._via_shm("put", lambda d: self._shm_put(d, items, ttl_s)):
            return
        command = pb.PutRequest(ttl_s=ttl_s or 0.0).SerializeToString()
        descriptor = flight.FlightDescriptor.for_command(command)
        lanes: list[list[pa.RecordBatch]] = [[] for _ in range(self.streams)]
        small: list[pa.RecordBatch] = []
        for key, meta, data, checksum in _put_items(items):
            buf = as_buffer(data)
            if buf.size < self.split_put_bytes or self.streams == 1:
                small.append(object_batch(key, meta, buf, checksum=checksum))
                continue
            step = -(-buf.size // self.streams)
            for lane, off in enumerate(range(0, buf.size, step)):
                part = buf.slice(off, min(step, buf.size - off))
                lanes[lane].append(object_batch(key, meta, part, offset=off, total=buf.size,
                                                checksum=checksum))
        if small:
            lanes[0] = small + lanes[0]

        def send(batches: list[pa.RecordBatch]) -> Callable[[flight.FlightClient], None]:
            def run(conn: flight.FlightClient) -> None:
                writer, _ = conn.do_put(descriptor, SCHEMA, options=self._options())
                try:
                    for batch in batches:
                        writer.write_batch(batch)
                finally:
                    writer.close()
            return run

        self._parallel("put", [send(b) for b in lanes if b])

    def _read(self, conn: flight.FlightClient, req: Any) -> list[Row]:
        reader = conn.do_get(flight.Ticket(req.SerializeToString()), options=self._options())
        return [row for chunk in reader for row in iter_objects(chunk.data)]

    def _range_task(self, key: str, offset: int, length: int
                    ) -> Callable[[flight.FlightClient], list[Row]]:
        return lambda c: self._read(c, pb.GetRequest(keys=[key], offset=offset, length=length))

    def _fetch(self, keys: Sequence[str]) -> list[tuple[bytes, int, list[Row]] | None]:
        """Per key: (metadata, size, pieces) or None. The first read takes up to
        `parallel_bytes * streams` of each object (one round trip for most objects); what is
        left of larger ones is fetched in byte ranges over parallel streams. The server answers
        a range with one row, or one per part it stored the object in."""
        head = self.parallel_bytes * self.streams
        first = self._call("get", lambda c: self._read(c, pb.GetRequest(keys=list(keys), length=head)))
        rows = iter(first)
        out: list[tuple[bytes, int, list[Row]] | None] = []
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
                step = -(-(row.total - got) // self.streams)
                starts = list(range(got, row.total, step))
                tasks = [self._range_task(key, o, min(step, row.total - o)) for o in starts]
                for o, answer in zip(starts, self._parallel("get", tasks), strict=True):
                    it = iter(answer)
                    lead = next(it, None)
                    if lead is None or not lead.found or lead.total != row.total:
                        raise KVStoreClientError(f"get {key!r}: the object changed or vanished "
                                                 f"while it was read")
                    pieces += [lead, *_rest_of_range(it, key, lead, o, min(o + step, row.total))]
            out.append((row.metadata, row.total, pieces))
        return out

    def get(self, keys: Sequence[str]) -> list[KVObject | None]:
        """The objects (payloads as pyarrow Buffers, with their checksums), None where a key is
        absent."""
        if not keys:
            return []
        got = self._via_shm("get", lambda d: self._shm_get(d, keys))
        if got is not None:
            return [None if g is None else KVObject(g[0], pa.py_buffer(g[1]), g[2]) for g in got]
        out: list[KVObject | None] = []
        for fetched in self._fetch(keys):
            if fetched is None:
                out.append(None)
                continue
            meta, total, pieces = fetched
            if len(pieces) == 1:
                out.append(KVObject(meta, pieces[0].data, pieces[0].checksum))
                continue
            buf = pa.allocate_buffer(total)  # Arrow's pool recycles pages: no page faults
            _copy_pieces(pieces, np.frombuffer(buf, dtype=np.uint8))
            out.append(KVObject(meta, buf, pieces[0].checksum))
        return out

    def get_stream(self, keys: Sequence[str], batch: int = 8
                   ) -> Iterator[tuple[int, KVObject | None]]:
        """Yields (index in `keys`, object or None) for every key, in order, holding one payload
        at a time: through shared memory each payload is read into one reused buffer, valid only
        until the next item (copy what you keep), in one round trip for all keys; over Flight,
        `batch` keys per call."""
        located = self._via_shm("get", lambda d: (d, self._shm_locate(keys))) if keys else None
        if located is None:
            for lo in range(0, len(keys), batch):
                yield from enumerate(self.get(keys[lo:lo + batch]), start=lo)
            return
        directory, objects = located
        scratch = np.empty(0, dtype=np.uint8)
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            if not obj.found:
                yield i, None
                continue
            if obj.file:
                if scratch.size < obj.size:
                    scratch = np.empty(obj.size, dtype=np.uint8)
                try:
                    data = shm.read_file(directory, obj.file, obj.size, scratch[:obj.size])
                except FileNotFoundError:  # dropped since: whatever the store has now
                    if not os.path.isdir(directory):  # the server restarted: ask it again
                        self._shm_failed("get", FileNotFoundError(directory))
                else:
                    yield i, KVObject(obj.metadata, pa.py_buffer(data), obj.checksum)
                    continue
            yield i, self.get([key])[0]

    def get_into(self, keys: Sequence[str], outs: Sequence[Any],
                 checksums: list[bytes] | None = None) -> list[bytes | None]:
        """Copies each found payload into `outs[i]` (a writable numpy array or anything
        `np.asarray` views without copying, e.g. `tensor.numpy()`), which must have exactly the
        payload's size; received bytes are copied once, straight into place. Returns each
        object's metadata, None where the key is absent. A `checksums` list given is filled
        with each object's checksum (b"" where absent or none)."""
        if len(keys) != len(outs):
            raise ValueError(f"get_into: {len(keys)} keys but {len(outs)} output buffers")
        if checksums is not None:
            checksums.clear()
        if not keys:
            return []
        got = self._via_shm("get", lambda d: self._shm_get(d, keys, outs))
        if got is not None:
            if checksums is not None:
                checksums.extend(b"" if g is None else g[2] for g in got)
            return [None if g is None else g[0] for g in got]
        metas: list[bytes | None] = []
        for key, fetched, out in zip(keys, self._fetch(keys), outs, strict=True):
            if checksums is not None:
                checksums.append(b"" if fetched is None else fetched[2][0].checksum)
            if fetched is None:
                metas.append(None)
                continue
            meta, total, pieces = fetched
            _copy_pieces(pieces, _out_bytes(key, out, total))
            metas.append(meta)
        return metas

    # --- control plane ----------------------------------------------------------------
    def _action(self, name: str, message: Any, response_type: Any) -> Any:
        body = message.SerializeToString()

        def run(conn: flight.FlightClient) -> Any:
            results = list(conn.do_action(flight.Action(name, body), options=self._options()))
            resp = response_type()
            resp.ParseFromString(results[0].body.to_pybytes())
            return resp

        return self._call(name, run)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are all present (the cached prefix)."""
        if not keys:
            return 0
        return int(self._action("lookup", pb.LookupRequest(keys=list(keys)),
                                pb.LookupResponse).prefix_len)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return list(self._action("exists", pb.KeysRequest(keys=list(keys)), pb.LookupResponse).present)

    def delete(self, keys: Sequence[str]) -> int:
        return int(self._action("delete", pb.KeysRequest(keys=list(keys)), pb.CountResponse).count)

    def lease(self, keys: Sequence[str], ttl_s: float) -> int:
        return int(self._action("lease", pb.KeysRequest(keys=list(keys), ttl_s=ttl_s),
                                pb.CountResponse).count)

    def release(self, keys: Sequence[str]) -> int:
        return int(self._action("release", pb.KeysRequest(keys=list(keys)), pb.CountResponse).count)

    def pin(self, keys: Sequence[str]) -> int:
        return int(self._action("pin", pb.KeysRequest(keys=list(keys)), pb.CountResponse).count)

    def unpin(self, keys: Sequence[str]) -> int:
        return int(self._action("unpin", pb.KeysRequest(keys=list(keys)), pb.CountResponse).count)

    def stats(self) -> StoreStats:
        r = self._action("stats", pb.Empty(), pb.StatsResponse)
        return StoreStats(r.backend, r.objects, r.bytes_used, r.capacity_bytes, r.hits, r.misses,
                          r.evictions, r.leased, r.pinned, r.max_object_bytes)

    def health(self) -> str:
        """"SERVING" or "NOT_SERVING"."""
        return str(self._action("health", pb.Empty(), pb.HealthResponse).status)

    def instance_id(self) -> str:
        """The server process's instance id (new at every start), "" when it is not serving."""
        reply = self._action("health", pb.Empty(), pb.HealthResponse)
        return str(reply.instance_id) if reply.status == "SERVING" else ""

    def metrics_text(self) -> str:
        """The server's Prometheus metrics in text format."""
        def run(conn: flight.FlightClient) -> str:
            results = list(conn.do_action(flight.Action("metrics", b""), options=self._options()))
            return str(results[0].body.to_pybytes().decode())

        return self._call("metrics", run)


def _put_items(items: Sequence[PutItem]) -> Iterator[tuple[str, bytes, Any, bytes]]:
    """Every item as (key, metadata, payload, checksum); b"" for an item without one."""
    for item in items:
        if len(item) == 4:
            yield item
        else:
            key, meta, data = item[:3]
            yield key, meta, data, b""


def _copy_pieces(pieces: list[Row], dst: np.ndarray) -> np.ndarray:
    """Lays each received piece at its offset in `dst` (uint8); returns `dst`."""
    for p in pieces:
        dst[p.offset:p.offset + p.data.size] = np.frombuffer(p.data, dtype=np.uint8)
    return dst


def _check_dir(directory: str) -> None:
    """Raises when the shared-memory directory itself is gone (the server restarted)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"shared-memory directory {directory} is gone")


def _out_bytes(key: str, out: Any, total: int) -> np.ndarray:
    """`out` viewed as `total` writable bytes (ValueError naming the key if it is not)."""
    dst = np.asarray(out).reshape(-1).view(np.uint8)
    if dst.size != total:
        raise ValueError(f"get_into {key!r}: output holds {dst.size} bytes, the object "
                         f"has {total}")
    return dst


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


def _server_message(exc: Exception) -> str:
    """The server's own message out of pyarrow's wrapping ("... Detail: ...")."""
    text = str(exc)
    return text.split(". Detail:")[0].replace("Invalid: ", "", 1).strip()
