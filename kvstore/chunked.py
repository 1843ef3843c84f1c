"""A payload kept as the parts it arrived in, so the server never copies a large object to
make it contiguous.

Parallel puts deliver a large object as a few parts (one per stream); each part is already one
Arrow buffer received from the network. The memory backend stores them as they are; a get sends
them back as one Flight row per part within the asked range (zero-copy slices). Only consumers
that need one contiguous buffer (the Redis backend, the `lm://` server) call `contiguous`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kvstore.shm import ShmFile


class ChunkedPayload:
    """Parts laid end to end: `parts[i]` starts at `starts[i]`; `size` bytes in all."""

    def __init__(self, parts: Sequence[pa.Buffer]) -> None:
        if not parts:
            raise ValueError("a chunked payload needs at least one part")
        self.parts = tuple(parts)
        self.starts = tuple(int(s) for s in np.cumsum([0, *[p.size for p in self.parts[:-1]]]))
        self.size = self.starts[-1] + self.parts[-1].size

    def __len__(self) -> int:
        return self.size

    def pieces(self, start: int, end: int) -> list[tuple[int, pa.Buffer]]:
        """(offset, zero-copy slice) for the bytes [start, end), in order."""
        out = []
        for begin, part in zip(self.starts, self.parts, strict=True):
            lo, hi = max(start, begin), min(end, begin + part.size)
            if lo < hi:
                out.append((lo, part.slice(lo - begin, hi - lo)))
        return out

    def contiguous(self) -> pa.Buffer:
        """One buffer holding every byte (a copy)."""
        buf = pa.allocate_buffer(self.size)
        view = np.frombuffer(buf, dtype=np.uint8)
        for begin, part in zip(self.starts, self.parts, strict=True):
            view[begin:begin + part.size] = np.frombuffer(part, dtype=np.uint8)
        return buf


def contiguous(data: Any) -> Any:
    """`data` itself, or one buffer with its bytes when it is a ChunkedPayload or a
    shared-memory file (kvstore.shm.ShmFile)."""
    return data.contiguous() if isinstance(data, ChunkedPayload | ShmFile) else data
