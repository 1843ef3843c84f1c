"""The end of a streaming call reaches its engine request and its span when the call ends, not
when grpc.aio's handler generator happens to be collected.

grpc.aio runs a streaming handler (an async generator) in a task and sends what it yields. When
the call ends while that task waits on a send (the caller closed the stream on the chunk it just
got, or left mid-stream), the task is cancelled outside the generator: the generator stays
suspended at its `yield`, and is closed only once it is collected. That is at once when nothing
else refers to it, but at the cyclic collector's next full pass when something does, seconds to
minutes later in a busy worker. Until then its engine request would run on for nobody and its
span would be missing (CI once waited 30 s for a decode worker's span that never came).

`CallEnd` runs the handler's end once, whichever comes first: the handler itself (its `finally`,
or earlier, on its last item) or the call's done callback, which closes the handler's source
(`items`; closing it aborts the engine request) and ends the call as cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc


class CallEnd:
    def __init__(self, context: grpc.aio.ServicerContext, items: AsyncGenerator[Any, None],
                 on_end: Callable[[bool], None]) -> None:
        """`on_end(cancelled)` runs once; `items` is what the handler iterates."""
        self._items = items
        self._on_end = on_end
        self.ended = False
        self._closing: asyncio.Task[None] | None = None
        context.add_done_callback(self._call_done)

    def end(self, cancelled: bool) -> None:
        if not self.ended:
            self.ended = True
            self._on_end(cancelled)

    def _call_done(self, _context: Any) -> None:
        """The call is over (its status sent, or the caller gone). A handler that finished has
        ended already; one that has not was cancelled, and may never run again."""
        if not self.ended:
            self._closing = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        # RuntimeError: the generator is running, so the task's cancellation reaches it there
        with contextlib.suppress(RuntimeError):
            await self._items.aclose()
        self.end(cancelled=True)
