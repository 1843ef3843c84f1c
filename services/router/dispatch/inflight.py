"""The router's calls in flight on workers, and the watchdog that ends the ones going nowhere.

A Decode stream that brings nothing (not even a worker heartbeat, services/worker/heartbeats.py)
for `stall_timeout_s` is stalled: its worker froze, or its engine did. Any call on a worker its
pool marks unhealthy (unreachable, not serving, reports late) is ended too. Either way the call
is cancelled with a reason, and the dispatcher, which sees the cancellation, raises
EndedByRouter (a WorkerError of kind "unavailable") and moves the sample to another worker.
The cancelled call is gone on the router's side: a frozen worker that wakes can send nothing
more into the client's stream, and it aborts the request when it sees the cancellation.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Literal

from services.router.dispatch.background import Background
from services.worker.client import WorkerError

Why = Literal["stalled", "unhealthy"]


class EndedByRouter(WorkerError):
    """A call the router ended: `why` it did."""

    def __init__(self, target: str, why: Why, message: str) -> None:
        super().__init__(target, "unavailable", message)
        self.why = why


class Attempt:
    """One call of one sample on one worker. `watch_stall`: end it after `stall_timeout_s`
    without news (Decode streams; a Prefill has no heartbeats and is only ended when its worker
    goes unhealthy)."""

    __slots__ = ("cancel", "ended", "last", "target", "watch_stall")

    def __init__(self, target: str, cancel: Callable[[], object], watch_stall: bool) -> None:
        self.target = target
        self.cancel = cancel
        self.watch_stall = watch_stall
        self.last = time.monotonic()
        self.ended: EndedByRouter | None = None  # why the router ended it, once it did

    def touch(self) -> None:
        self.last = time.monotonic()

    def pause(self) -> None:
        """No stall while the caller holds a step (a slow client is not a stalled worker)."""
        self.last = math.inf

    def end(self, why: Why, message: str) -> None:
        if self.ended is None:
            self.ended = EndedByRouter(self.target, why, message)
            self.cancel()


class InFlight:
    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._attempts: set[Attempt] = set()
        self._watcher = Background(self._watch)

    def add(self, attempt: Attempt) -> Attempt:
        self._attempts.add(attempt)
        return attempt

    def discard(self, attempt: Attempt) -> None:
        self._attempts.discard(attempt)

    def end_all_on(self, target: str, reason: str, streams: bool = True) -> int:
        """Ends the calls on the worker at `target` (Decode streams too with `streams`: when
        the worker is unreachable, not when it may only be slow); returns how many."""
        ended = [a for a in self._attempts if a.target == target and a.ended is None
                 and (streams or not a.watch_stall)]
        for a in ended:
            a.end("unhealthy", reason)
        return len(ended)

    def check(self) -> None:
        """Ends stalled streams (called every quarter of the stall timeout)."""
        now, limit = time.monotonic(), self.stall_timeout_s
        for a in [a for a in self._attempts if a.watch_stall and now - a.last > limit]:
            a.end("stalled", f"no output or heartbeat for {now - a.last:.1f} s (stall timeout {limit:g} s)")

    def start(self) -> None:
        self._watcher.start()

    async def close(self) -> None:
        await self._watcher.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.stall_timeout_s / 4)
            self.check()
