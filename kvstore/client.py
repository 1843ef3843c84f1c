"""Client of the KV store server (used by the KV connector): batched put / get / lookup over
Arrow Flight, control actions, timeouts, and one reconnect-and-retry when the connection broke
(every operation is idempotent: a put replaces, a get reads).

Payloads go out as Arrow buffers laid over the caller's memory (bytes, numpy arrays, tensors
through `kvstore.lmcache_format.tensor_to_buffer`), and `get_into` copies each received payload
once, straight into a caller's preallocated buffer (a numpy array or a tensor's numpy view).

This module holds the public API; the work is done by:
- kvstore/link.py: the channels, the breaker, and the client's errors (re-exported here);
- kvstore/flight_data.py: puts split over parallel streams, gets read in ranges;
- kvstore/shm_client.py: the same-host path, through files in the server's shared-memory
  directory when this process sees it (Flight for whatever it cannot serve).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from kvstore import flight_data
from kvstore.backend import KVObject
from kvstore.connect import StoreCredentials
from kvstore.flight_data import Fetched, PutItem, copy_pieces, out_bytes
from kvstore.link import (
    CHANNEL_OPTIONS,
    KVStoreAuthError,
    KVStoreClientError,
    KVStoreRejectedError,
    StoreLink,
)
from kvstore.shm_client import ShmPath
from protos import kvstore_pb2 as pb

__all__ = ["CHANNEL_OPTIONS", "DEFAULT_LOCATION", "KVStoreAuthError", "KVStoreClient",
           "KVStoreClientError", "KVStoreRejectedError", "PutItem", "StoreStats"]

DEFAULT_LOCATION = "grpc://127.0.0.1:50071"


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
        if streams < 1 or parallel_bytes < 1 or split_put_bytes < 1:
            raise ValueError(f"streams, parallel_bytes and split_put_bytes must be >= 1, got "
                             f"{streams}, {parallel_bytes}, {split_put_bytes}")
        self.location = location
        self.timeout_s = timeout_s
        self.streams = streams
        self.parallel_bytes = parallel_bytes
        self.split_put_bytes = split_put_bytes
        self.use_shm = use_shm
        self.breaker_s = breaker_s
        self._link = StoreLink(self.credentials, location, timeout_s, streams, breaker_s)
        self._shm = ShmPath(self._link, self._fetch, use_shm)

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shm_dir(self) -> str | None:
        """The server's shared-memory directory when this process sees it, else None (asked
        once; again `kvstore.shm_client.SHM_RETRY_S` after a failure, e.g. a full /dev/shm or
        a restarted server)."""
        return self._shm.dir()

    # --- data plane -------------------------------------------------------------------
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
        if self._shm.via("put", lambda d: self._shm.put(d, items, ttl_s)):
            return
        flight_data.put(self._link, items, ttl_s, self.split_put_bytes)

    def _fetch(self, keys: Sequence[str]) -> list[Fetched | None]:
        return flight_data.fetch(self._link, keys, self.parallel_bytes)

    def get(self, keys: Sequence[str]) -> list[KVObject | None]:
        """The objects (payloads as pyarrow Buffers, with their checksums), None where a key is
        absent."""
        if not keys:
            return []
        got = self._shm.via("get", lambda d: self._shm.get(d, keys))
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
            copy_pieces(pieces, np.frombuffer(buf, dtype=np.uint8))
            out.append(KVObject(meta, buf, pieces[0].checksum))
        return out

    def get_stream(self, keys: Sequence[str], batch: int = 8
                   ) -> Iterator[tuple[int, KVObject | None]]:
        """Yields (index in `keys`, object or None) for every key, in order, holding one payload
        at a time: through shared memory each payload is read into one reused buffer, valid only
        until the next item (copy what you keep), in one round trip for all keys; over Flight,
        `batch` keys per call."""
        located = self._shm.via("get", lambda d: (d, self._shm.locate(keys))) if keys else None
        if located is None:
            for lo in range(0, len(keys), batch):
                yield from enumerate(self.get(keys[lo:lo + batch]), start=lo)
            return
        directory, objects = located
        yield from self._shm.stream(directory, keys, objects, lambda key: self.get([key])[0])

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
        got = self._shm.via("get", lambda d: self._shm.get(d, keys, outs))
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
            copy_pieces(pieces, out_bytes(key, out, total))
            metas.append(meta)
        return metas

    # --- control plane ----------------------------------------------------------------
    def _action(self, name: str, message: Any, response_type: Any) -> Any:
        return self._link.action(name, message, response_type)

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
            results = list(conn.do_action(flight.Action("metrics", b""), options=self._link.options()))
            return str(results[0].body.to_pybytes().decode())

        return self._link.call("metrics", run)
