"""Heartbeats on a stream: an item source that may go quiet for long (a request queued, loading
KV, or in a long prefill step) gets a None each interval while its producer is alive, so the
consumer at the other end of the network can tell a quiet stream from a stalled worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


async def with_heartbeats(items: AsyncIterator[T], interval_s: float, alive: Callable[[], bool]
                          ) -> AsyncGenerator[T | None, None]:
    """`items`, with a None each time `interval_s` passes without one while `alive()` says so.
    The pending item is never cancelled by a heartbeat (that would end an async generator)."""
    pending: asyncio.Future[T] = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                if alive():
                    yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
