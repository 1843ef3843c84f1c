"""Assembles large objects that clients send as parts over parallel Flight streams.

A part says which object it belongs to (key), where it goes (offset) and the object's size
(total). The first part of an object reserves `total` bytes against the pending bound; parts are
kept as the Arrow buffers they arrived in (no copy: the finished object is a ChunkedPayload of
them, in offset order); the object is handed back only when every byte arrived, so nothing
partial is ever stored. Assemblies that stall for `timeout_s` are dropped, and the bytes held by
unfinished assemblies are bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from kvstore.backend import CapacityError, InvalidRequestError
from kvstore.chunked import ChunkedPayload


@dataclass
class _Pending:
    total: int
    metadata: bytes
    checksum: bytes  # as the first part carried it (every part carries the object's)
    deadline: float
    received: int = 0
    parts: dict[int, pa.Buffer] = field(default_factory=dict)  # offset -> bytes


class PartAssembler:
    def __init__(self, max_pending_bytes: int, timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return sum(p.total for p in self._pending.values())

    def add(self, key: str, metadata: bytes, offset: int, total: int, data: pa.Buffer,
            checksum: bytes = b"") -> tuple[bytes, ChunkedPayload, bytes] | None:
        """Places one part; returns (metadata, whole payload, checksum) once the object is
        complete."""
        n = data.size
        if total <= 0 or offset < 0 or offset + n > total or n == 0:
            raise InvalidRequestError(f"put {key!r}: part [{offset}, {offset + n}) does not fit an "
                                      f"object of {total} bytes")
        now = self._clock()
        with self._lock:
            for stale in [k for k, p in self._pending.items() if p.deadline < now]:
                del self._pending[stale]
            pending = self._pending.get(key)
            if pending is None or pending.total != total:  # new object (or a restarted one)
                held = sum(p.total for k, p in self._pending.items() if k != key)
                if held + total > self.max_pending_bytes:
                    raise CapacityError(f"put {key!r}: {held} bytes of unfinished parallel puts "
                                        f"already held; {total} more exceed {self.max_pending_bytes}")
                pending = _Pending(total, metadata, checksum, now + self.timeout_s)
                self._pending[key] = pending
            if any(offset < start + part.size and start < offset + n
                   for start, part in pending.parts.items()):
                raise InvalidRequestError(f"put {key!r}: part [{offset}, {offset + n}) overlaps "
                                          f"a part already received")
            pending.parts[offset] = data
            pending.received += n
            pending.deadline = now + self.timeout_s
            if pending.received < total:
                return None
            del self._pending[key]
        return (pending.metadata, ChunkedPayload([pending.parts[o] for o in sorted(pending.parts)]),
                pending.checksum)
