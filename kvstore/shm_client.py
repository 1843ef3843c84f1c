"""The KV store client's same-host path (used by kvstore/client.py; files: kvstore/shm.py).

When the server has a shared-memory directory this process can see, puts write each payload
once into a file there and send only names, and gets read the files the server names; objects
the server holds outside that directory still come over Flight, and any trouble with the
directory (full, gone after a server restart) falls back to Flight for that call and asks the
server again `SHM_RETRY_S` later.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from kvstore import shm
from kvstore.backend import KVObject
from kvstore.flight_data import Fetched, PutItem, copy_pieces, out_bytes, put_items
from kvstore.link import KVStoreClientError, KVStoreRejectedError, StoreLink
from kvstore.wire import as_buffer
from protos import kvstore_pb2 as pb

logger = logging.getLogger(__name__)
T = TypeVar("T")
SHM_RETRY_S = 10.0  # after the shared-memory path failed, Flight only for this long
# (metadata, payload as a uint8 array, checksum) per found key
ShmGot = tuple[bytes, Any, bytes]


class ShmPath:
    """The shared-memory path of one client (off unless `enabled`). `fetch` reads keys over
    Flight, for the objects the server holds outside the directory."""

    def __init__(self, link: StoreLink, fetch: Callable[[Sequence[str]], list[Fetched | None]],
                 enabled: bool) -> None:
        self.link = link
        self.fetch = fetch
        self.enabled = enabled
        self._dir: str | None = None
        self._checked = False
        self._retry_at = 0.0  # after a failure: Flight only until then

    def dir(self) -> str | None:
        """The server's shared-memory directory when this process sees it, else None (asked
        once; again `SHM_RETRY_S` after a failure, e.g. a full /dev/shm or a restarted server)."""
        if not self.enabled or time.monotonic() < self._retry_at:
            return None
        if not self._checked:
            try:
                info = self.link.action("shm_info", pb.Empty(), pb.ShmInfo)
                self._dir = shm.usable_dir(info.dir, info.token)
            except KVStoreClientError as exc:
                if "unknown action" not in str(exc):
                    raise  # unreachable etc.: the caller's Flight call says so
                self._dir = None  # a server without this path
            self._checked = True
        return self._dir

    def via(self, op: str, fn: Callable[[str], T]) -> T | None:
        """`fn(directory)` through the shared-memory path, or None when this call goes over
        Flight (no directory this process sees, or the path failed: then Flight only for
        SHM_RETRY_S). A request the server refuses as such raises."""
        if not self.enabled:
            return None
        try:
            directory = self.dir()
            return None if directory is None else fn(directory)
        except KVStoreRejectedError:
            raise
        except (OSError, KVStoreClientError) as exc:
            self.failed(op, exc)
            return None

    def failed(self, op: str, exc: Exception) -> None:
        """Flight only for SHM_RETRY_S, then the server is asked for its directory again."""
        logger.info("%s through shared memory failed (%s); using Flight for %.0f s", op, exc,
                    SHM_RETRY_S)
        self._dir, self._checked = None, False
        self._retry_at = time.monotonic() + SHM_RETRY_S

    def put(self, directory: str, items: Sequence[PutItem], ttl_s: float | None) -> bool:
        """Writes each payload into a file in `directory` and hands the files to the server."""
        req = pb.ShmPutRequest(ttl_s=ttl_s or 0.0)
        try:
            for key, meta, data, checksum in put_items(items):
                buf = as_buffer(data)
                req.objects.add(key=key, metadata=meta, file=shm.write_file(directory, buf),
                                size=buf.size, checksum=checksum)
            self.link.action("shm_put", req, pb.CountResponse)
        except BaseException:
            for obj in req.objects:  # the server deletes what it did not adopt; in case it
                shm.discard_file(directory, obj.file)  # never got the call
            raise
        return True

    def locate(self, keys: Sequence[str]) -> list[Any]:
        """The server's ShmObject per key, checked to answer `keys` in order."""
        resp = self.link.action("shm_get", pb.KeysRequest(keys=list(keys)), pb.ShmGetResponse)
        if len(resp.objects) != len(keys):
            raise KVStoreClientError(f"shm_get: {len(resp.objects)} answers for {len(keys)} keys")
        for key, obj in zip(keys, resp.objects, strict=True):
            if obj.key != key:
                raise KVStoreClientError(f"shm_get: the answer for {key!r} is out of order")
        return list(resp.objects)

    def get(self, directory: str, keys: Sequence[str], outs: Sequence[Any] | None = None
            ) -> list[ShmGot | None]:
        """Per key (metadata, payload array, checksum) or None; objects outside shared memory
        (or dropped since the server named their file) come over Flight. With `outs`, each
        payload is read into `outs[i]` (see KVStoreClient.get_into)."""
        out: list[ShmGot | None] = []
        rest: list[int] = []
        for i, (key, obj) in enumerate(zip(keys, self.locate(keys), strict=True)):
            out.append(None)
            if not obj.found:
                continue
            if not obj.file:
                rest.append(i)
                continue
            dst = None if outs is None else out_bytes(key, outs[i], obj.size)
            try:
                out[i] = (obj.metadata, shm.read_file(directory, obj.file, obj.size, dst),
                          obj.checksum)
            except FileNotFoundError:
                _check_dir(directory)
                rest.append(i)
        if rest:
            for i, fetched in zip(rest, self.fetch([keys[i] for i in rest]), strict=True):
                if fetched is None:
                    continue
                meta, total, pieces = fetched
                dst = (np.empty(total, dtype=np.uint8) if outs is None
                       else out_bytes(keys[i], outs[i], total))
                out[i] = (meta, copy_pieces(pieces, dst), pieces[0].checksum)
        return out

    def stream(self, directory: str, keys: Sequence[str], objects: list[Any],
               get_one: Callable[[str], KVObject | None]) -> Iterator[tuple[int, KVObject | None]]:
        """Yields (index, object or None) for `keys` as `locate` found them, each file read into
        one reused buffer (valid until the next item); `get_one` reads the others."""
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
                        self.failed("get", FileNotFoundError(directory))
                else:
                    yield i, KVObject(obj.metadata, pa.py_buffer(data), obj.checksum)
                    continue
            yield i, get_one(key)


def _check_dir(directory: str) -> None:
    """Raises when the shared-memory directory itself is gone (the server restarted)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"shared-memory directory {directory} is gone")
