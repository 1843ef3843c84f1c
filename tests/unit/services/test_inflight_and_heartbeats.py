"""Without a network: the router's watchdog ends stalled streams and the calls on a worker gone
unhealthy, once each, with the reason; a quiet stream gets heartbeats only while its producer is
alive, and a heartbeat never cancels the item it waits for; the engine guard's limits are checked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.router.dispatch.inflight import Attempt, InFlight
from services.worker.engine_guard import GuardOptions
from services.worker.heartbeats import with_heartbeats


def test_stalled_streams_and_calls_on_an_unhealthy_worker_are_ended_once_with_why() -> None:
    cancelled: list[str] = []
    inflight = InFlight(stall_timeout_s=0.05)
    quiet = inflight.add(Attempt("w1", lambda: cancelled.append("quiet"), watch_stall=True))
    busy = inflight.add(Attempt("w1", lambda: cancelled.append("busy"), watch_stall=True))
    prefill = inflight.add(Attempt("w2", lambda: cancelled.append("prefill"), watch_stall=False))
    time.sleep(0.08)
    busy.touch()
    inflight.check()
    assert cancelled == ["quiet"] and quiet.ended is not None and quiet.ended.why == "stalled"
    assert "stall timeout" in quiet.ended.message and busy.ended is None and prefill.ended is None
    inflight.check()
    assert cancelled == ["quiet"]  # ended once
    assert inflight.end_all_on("w2", "not serving: restarting", streams=False) == 1
    assert prefill.ended is not None and prefill.ended.why == "unhealthy" and cancelled[-1] == "prefill"
    assert inflight.end_all_on("w1", "late reports", streams=False) == 0  # streams: the stall timeout
    busy.pause()  # the caller holds a step: no stall however long
    time.sleep(0.08)
    inflight.check()
    assert busy.ended is None
    assert inflight.end_all_on("w1", "unreachable") == 1 and busy.ended is not None
    inflight.discard(busy)
    assert inflight.end_all_on("w1", "gone") == 0  # quiet already ended, busy no longer in flight


async def test_heartbeats_come_while_alive_and_never_cancel_the_pending_item() -> None:
    alive = [True]
    release = asyncio.Event()
    cancelled = []

    async def source() -> AsyncIterator[int]:
        yield 1
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield 2

    got: list[int | None] = []

    async def consume() -> None:
        async for item in with_heartbeats(source(), 0.02, lambda: alive[0]):
            got.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    beats = got.count(None)
    assert got[0] == 1 and beats >= 2
    alive[0] = False
    await asyncio.sleep(0.1)
    assert got.count(None) == beats  # a dead producer gets no heartbeat
    release.set()
    await asyncio.wait_for(task, 1)
    assert got[-1] == 2 and not cancelled


def test_guard_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unready_after_s"):
        GuardOptions(unready_after_s=20, silence_s=10)
    with pytest.raises(ValueError, match="step_timeout_s"):
        GuardOptions(step_timeout_s=0)
    with pytest.raises(ValueError, match="max_restarts"):
        GuardOptions(max_restarts=-1)
