"""Assembly of objects sent in parts: complete only when every byte arrived, bounded, expiring."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvstore.assembler import PartAssembler
from kvstore.backend import CapacityError, InvalidRequestError


def part(data: bytes) -> pa.Buffer:
    return pa.py_buffer(data)


def test_parts_in_any_order_give_the_whole_object_once() -> None:
    payload = bytes(range(10))
    a = PartAssembler(max_pending_bytes=100)
    assert a.add("k", b"m", 6, 10, part(payload[6:])) is None
    assert a.add("k", b"m", 0, 10, part(payload[:3])) is None
    done = a.add("k", b"m", 3, 10, part(payload[3:6]))
    assert done is not None and done[0] == b"m" and done[1].contiguous().to_pybytes() == payload
    assert a.pending_bytes == 0


def test_overlapping_and_overflowing_parts_are_refused() -> None:
    a = PartAssembler(max_pending_bytes=100)
    a.add("k", b"m", 0, 10, part(b"abcd"))
    with pytest.raises(InvalidRequestError, match="overlaps"):
        a.add("k", b"m", 2, 10, part(b"xy"))
    with pytest.raises(InvalidRequestError, match="does not fit"):
        a.add("k", b"m", 8, 10, part(b"xyz"))


def test_pending_bytes_are_bounded() -> None:
    a = PartAssembler(max_pending_bytes=15)
    a.add("a", b"", 0, 10, part(b"x"))
    with pytest.raises(CapacityError, match="unfinished parallel puts"):
        a.add("b", b"", 0, 10, part(b"x"))


def test_stalled_assemblies_expire() -> None:
    now = [0.0]
    a = PartAssembler(max_pending_bytes=15, timeout_s=5, clock=lambda: now[0])
    a.add("a", b"", 0, 10, part(b"x"))
    now[0] = 6.0
    a.add("b", b"", 0, 10, part(b"y"))  # the stale "a" was dropped, so "b" fits
    assert a.pending_bytes == 10


def test_a_finished_object_keeps_its_parts_and_serves_any_range() -> None:
    payload = bytes(range(10))
    a = PartAssembler(max_pending_bytes=100)
    a.add("k", b"m", 4, 10, part(payload[4:]))
    done = a.add("k", b"m", 0, 10, part(payload[:4]))
    assert done is not None
    chunked = done[1]
    assert len(chunked) == chunked.size == 10 and len(chunked.parts) == 2
    for start, end in [(0, 10), (0, 4), (3, 5), (4, 9), (9, 10), (5, 5)]:
        pieces = chunked.pieces(start, end)
        assert b"".join(p.to_pybytes() for _, p in pieces) == payload[start:end]
        assert [o for o, _ in pieces] == sorted({start, *([4] if start < 4 < end else [])}
                                                 )[:len(pieces)]
