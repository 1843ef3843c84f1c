"""Rank 0's step messages to the other ranks of its engine: one shared-memory buffer, one writer,
`readers` readers (vLLM's shared-memory broadcast queue, in small).

    channel = StepChannel(ctx, readers=1)          # rank 0, before it starts the other ranks
    channel.send(StepMessage(scheduler_output))    # rank 0, every step
    message = channel.reader(0).recv(alive)        # rank 1, in its own process

A message is msgpack (msgspec, typed: no pickle) in a buffer of `size` bytes that every rank maps;
the writer waits until every reader took the last message before it writes the next one, and
each reader is woken by a semaphore of its own (no socket, no polling while a step runs).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from typing import Any

import msgspec

from engine.core.outputs import SchedulerOutput

# A step's message holds the whole token ids of the requests it starts or resumes (about 5
# bytes a token): 64 MiB is some 13 million tokens.
BUFFER_BYTES = 64 * 2**20
_LEN = struct.Struct("<Q")


@dataclass
class StepMessage:
    """One step's scheduler output (its connector metadata left out), the tokens rank 0 sampled
    in the step before (the other ranks append them to their requests, as rank 0 did), or the
    engine's start (`num_kv_blocks`, once) or end (`shutdown`)."""

    scheduler_output: SchedulerOutput | None = None
    sampled: dict[str, list[int]] = field(default_factory=dict)
    num_kv_blocks: int = 0
    max_model_len: int = 0
    kv_cache_fds: list[int] = field(default_factory=list)  # rank 0's fd of each other rank's cache
    layer_sync: bool = False  # the step loads KV layer by layer: wait for rank 0 before each layer
    shutdown: bool = False


class ChannelClosed(RuntimeError):
    """The other side is gone (or did not answer within the timeout)."""


class StepReader:
    """One reader's end (picklable: handed to a rank's process when it starts)."""

    def __init__(self, buffer: Any, ready: Any, taken: Any) -> None:
        self.buffer, self.ready, self.taken = buffer, ready, taken
        self._decoder = msgspec.msgpack.Decoder(StepMessage)

    def __getstate__(self) -> dict[str, Any]:
        return {"buffer": self.buffer, "ready": self.ready, "taken": self.taken}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["buffer"], state["ready"], state["taken"])  # type: ignore[misc]

    def recv(self, alive: Callable[[], bool], poll_s: float = 0.5) -> StepMessage:
        """The next message; waits while `alive()` (the writer's process is) holds."""
        while not self.ready.acquire(timeout=poll_s):
            if not alive():
                raise ChannelClosed("rank 0 is gone")
        view = memoryview(self.buffer).cast("B")
        (n,) = _LEN.unpack_from(view, 0)
        message = self._decoder.decode(view[_LEN.size:_LEN.size + n])
        self.taken.release()
        return message


class StepChannel:
    def __init__(self, ctx: SpawnContext, readers: int, size: int = BUFFER_BYTES) -> None:
        self.size = size
        self.buffer = ctx.RawArray(ctypes.c_uint8, size)
        self.readers = [StepReader(self.buffer, ctx.Semaphore(0), ctx.Semaphore(1))
                        for _ in range(readers)]
        self._encoder = msgspec.msgpack.Encoder()

    def reader(self, i: int) -> StepReader:
        return self.readers[i]

    def send(self, message: StepMessage, timeout_s: float) -> None:
        """Writes `message` once every reader took the last one (at most `timeout_s`)."""
        payload = self._encoder.encode(message)
        if _LEN.size + len(payload) > self.size:
            raise ValueError(f"a step message of {len(payload)} bytes exceeds the tensor-parallel "
                             f"channel's {self.size} bytes")
        for r in self.readers:
            if not r.taken.acquire(timeout=timeout_s):
                raise ChannelClosed(f"a rank took no step message for {timeout_s:.0f} s")
        view = memoryview(self.buffer).cast("B")
        _LEN.pack_into(view, 0, len(payload))
        view[_LEN.size:_LEN.size + len(payload)] = payload
        for r in self.readers:
            r.ready.release()
