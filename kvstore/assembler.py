"""Assembles large objects that clients send as parts over parallel Flight streams.

A part says which object it belongs to (key), where it goes (offset) and the object's size
(total). The first part of an object reserves one buffer of `total` bytes; every part is copied
into place (outside the lock, so parallel streams copy in parallel); the object is handed back
only when every byte arrived, so nothing partial is ever stored. Assemblies that stall for
`timeout_s` are dropped, and the bytes held by unfinished assemblies are bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvstore.backend import CapacityError, InvalidRequestError


@dataclass
class _Pending:
    buf: np.ndarray
    metadata: bytes
    deadline: float
    received: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)


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
            return sum(p.buf.size for p in self._pending.values())

    def add(self, key: str, metadata: bytes, offset: int, total: int,
            data: pa.Buffer) -> tuple[bytes, pa.Buffer] | None:
        """Places one part; returns (metadata, whole payload) once the object is complete."""
        n = data.size
        if total <= 0 or offset < 0 or offset + n > total or n == 0:
            raise InvalidRequestError(f"put {key!r}: part [{offset}, {offset + n}) does not fit an "
                                      f"object of {total} bytes")
        pending = self._reserve(key, metadata, offset, n, total)
        pending.buf[offset:offset + n] = np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            pending.received += n
            if pending.received < total or self._pending.get(key) is not pending:
                return None
            del self._pending[key]
        return pending.metadata, pa.py_buffer(pending.buf)

    def _reserve(self, key: str, metadata: bytes, offset: int, n: int, total: int) -> _Pending:
        now = self._clock()
        with self._lock:
            for stale in [k for k, p in self._pending.items() if p.deadline < now]:
                del self._pending[stale]
            pending = self._pending.get(key)
            if pending is None or pending.buf.size != total:  # new object (or a restarted one)
                held = sum(p.buf.size for k, p in self._pending.items() if k != key)
                if held + total > self.max_pending_bytes:
                    raise CapacityError(f"put {key!r}: {held} bytes of unfinished parallel puts "
                                        f"already held; {total} more exceed {self.max_pending_bytes}")
                pending = _Pending(np.empty(total, dtype=np.uint8), metadata, now + self.timeout_s)
                self._pending[key] = pending
            if any(offset < end and start < offset + n for start, end in pending.ranges):
                raise InvalidRequestError(f"put {key!r}: part [{offset}, {offset + n}) overlaps "
                                          f"a part already received")
            pending.ranges.append((offset, offset + n))
            pending.deadline = now + self.timeout_s
            return pending
