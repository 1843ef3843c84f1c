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
  directory when this process sees it (Flight for whatever it cannot serve);
- kvstore/frontends.py: several front-ends of one store (a comma-separated list, `dns:name:port`),
  the one each call goes to, and the move to the next when one is unreachable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from kvstore import flight_data
from kvstore.backend import KVObject
from kvstore.connect import StoreCredentials
from kvstore.flight_data import Fetched, PutItem, copy_pieces, out_bytes
from kvstore.frontends import MIN_FAILOVER_BREAKER_S, Frontends, Target, is_multi
from kvstore.link import (
    CHANNEL_OPTIONS,
    KVStoreAuthError,
    KVStoreClientError,
    KVStoreRejectedError,
    KVStoreUnavailableError,
    StoreLink,
)
from kvstore.shm_client import ShmPath
from protos import kvstore_pb2 as pb

__all__ = ["CHANNEL_OPTIONS", "DEFAULT_LOCATION", "KVStoreAuthError", "KVStoreClient",
           "KVStoreClientError", "KVStoreRejectedError", "KVStoreUnavailableError", "PutItem",
           "StoreStats"]

DEFAULT_LOCATION = "grpc://127.0.0.1:50071"
T = TypeVar("T")


@dataclass(frozen=True)
class _Front:
    """One front-end: its channels and breaker, and its same-host path."""

    link: StoreLink
    shm: ShmPath


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
    grpc+tls:// location (kvstore/connect.py).

    `location` is one store, or several front-ends of one store (kvstore/frontends.py):
    `grpc://a:50071,grpc://b:50071`, `dns:name:port`; each call goes to one of them and moves
    on to the next when that one is unreachable (then skipped for at least
    MIN_FAILOVER_BREAKER_S)."""

    def __init__(self, location: str = DEFAULT_LOCATION, timeout_s: float = 30.0,
                 streams: int = 4, parallel_bytes: int = 2 * 2**20,
                 split_put_bytes: int = 16 * 2**20, use_shm: bool = True, breaker_s: float = 0.0,
                 *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.credentials = StoreCredentials.resolve(token, tls_ca, tls_cert, tls_key)
        multi = is_multi(location)
        location = location if multi else self.credentials.location(location)
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
        front_breaker_s = max(breaker_s, MIN_FAILOVER_BREAKER_S) if multi else breaker_s

        def make(target: Target) -> _Front:
            link = StoreLink(self.credentials, target.location, timeout_s, streams,
                             front_breaker_s, target.server_name)
            return _Front(link, ShmPath(link, lambda keys: self._fetch(link, keys), use_shm))

        self._fronts: Frontends[_Front] = Frontends(location, make, lambda f: f.link.close(),
                                                    self.credentials.location)

    @property
    def _link(self) -> StoreLink:
        """The first front-end's link (the only one of a one-store client)."""
        return self._fronts.all()[0].link

    @property
    def _shm(self) -> ShmPath:
        return self._fronts.all()[0].shm

    def _run(self, hint: str | None, fn: Callable[[_Front], T]) -> T:
        """`fn` on the front-end for `hint` (a call's first key; None: the next in turn),
        moving on while front-ends are unreachable."""
        return self._fronts.run(hint, lambda f: f.link.is_down(), fn)

    def close(self) -> None:
        self._fronts.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shm_dir(self) -> str | None:
        """The server's shared-memory directory when this process sees it, else None (asked
        once; again `kvstore.shm_client.SHM_RETRY_S` after a failure, e.g. a full /dev/shm or
        a restarted server)."""
        return self._run("", lambda f: f.shm.dir())

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

        def put(f: _Front) -> None:
            if not f.shm.via("put", lambda d: f.shm.put(d, items, ttl_s)):
                flight_data.put(f.link, items, ttl_s, self.split_put_bytes)

        self._run(items[0][0], put)

    def _fetch(self, link: StoreLink, keys: Sequence[str]) -> list[Fetched | None]:
        return flight_data.fetch(link, keys, self.parallel_bytes)

    def get(self, keys: Sequence[str]) -> list[KVObject | None]:
        """The objects (payloads as pyarrow Buffers, with their checksums), None where a key is
        absent."""
        if not keys:
            return []
        return self._run(keys[0], lambda f: self._get(f, keys))

    def _get(self, f: _Front, keys: Sequence[str]) -> list[KVObject | None]:
        got = f.shm.via("get", lambda d: f.shm.get(d, keys))
        if got is not None:
            return [None if g is None else KVObject(g[0], pa.py_buffer(g[1]), g[2]) for g in got]
        out: list[KVObject | None] = []
        for fetched in self._fetch(f.link, keys):
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
        def locate(f: _Front) -> tuple[ShmPath, tuple[str, Any] | None]:
            return f.shm, f.shm.via("get", lambda d: (d, f.shm.locate(keys)))

        shm, located = self._run(keys[0], locate) if keys else (None, None)
        if shm is None or located is None:
            for lo in range(0, len(keys), batch):
                yield from enumerate(self.get(keys[lo:lo + batch]), start=lo)
            return
        directory, objects = located
        yield from shm.stream(directory, keys, objects, lambda key: self.get([key])[0])

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
        return self._run(keys[0], lambda f: self._get_into(f, keys, outs, checksums))

    def _get_into(self, f: _Front, keys: Sequence[str], outs: Sequence[Any],
                  checksums: list[bytes] | None) -> list[bytes | None]:
        if checksums is not None:
            checksums.clear()  # a call moved on from a failed front-end starts over
        got = f.shm.via("get", lambda d: f.shm.get(d, keys, outs))
        if got is not None:
            if checksums is not None:
                checksums.extend(b"" if g is None else g[2] for g in got)
            return [None if g is None else g[0] for g in got]
        metas: list[bytes | None] = []
        for key, fetched, out in zip(keys, self._fetch(f.link, keys), outs, strict=True):
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
        keys = getattr(message, "keys", None)
        hint = str(keys[0]) if keys else None
        return self._run(hint, lambda f: f.link.action(name, message, response_type))

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
        def run(link: StoreLink, conn: flight.FlightClient) -> str:
            results = list(conn.do_action(flight.Action("metrics", b""), options=link.options()))
            return str(results[0].body.to_pybytes().decode())

        return self._run(None, lambda f: f.link.call("metrics", lambda c: run(f.link, c)))
