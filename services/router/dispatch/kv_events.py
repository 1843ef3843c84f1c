"""Which blocks each worker's prefix cache really holds, from its KV cache events (vLLM's wire
format, engine/kv_events/): the router's precise prefix index.

A worker that publishes says where in its load reports. The router subscribes (SUB, the
worker's topic) and keeps the set of block hashes the worker's cache can hit: BlockStored adds,
BlockRemoved takes away, AllBlocksCleared empties (the first batch of every engine start says
so). Sequence numbers must run without gaps:
- a gap (a batch lost, or the first batch seen after joining mid-stream) is filled from the
  worker's replay socket (a DEALER asks from the first missing sequence); a batch the SUB
  socket delivers after a replay already applied it is skipped;
- the engine restarted (its publisher numbers from 0 again) when the SUB stream's sequence
  goes back, or when a load report names another publisher epoch: the index starts over;
- the load report says how many batches the worker has published, so a lost last batch (no
  later one to show the gap) is asked for too once a report has seen it published earlier.
The index is usable (`exact`) only while it has every batch since an AllBlocksCleared and is
not behind a report; otherwise (no stream yet, a replay that could not fill a gap, a restart
not caught up yet) the pool scores the worker with its approximate index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
END_SEQ = -1


class KVBlockIndex:
    """One worker's cached blocks (group 0's: the full-attention or only KV cache group)."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.last_seq = -1
        self.complete = False  # every batch since an AllBlocksCleared applied
        self.behind_since: int | None = None  # a report's published count we had not reached
        self.applied = 0  # batches applied (for stats and tests)

    @property
    def exact(self) -> bool:
        return self.complete and self.behind_since is None

    def match(self, hashes: Sequence[bytes], block_size: int) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n * block_size

    def reset(self) -> None:
        """Forget everything (the worker restarted, or was marked unhealthy)."""
        self.blocks.clear()
        self.last_seq, self.complete, self.behind_since = -1, False, None

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.group_idx in (None, 0):
                    self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.group_idx in (None, 0):
                    self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                self.complete = True
        self.last_seq = seq
        self.applied += 1
        if self.behind_since is not None and seq + 1 >= self.behind_since:
            self.behind_since = None


class KVEventFeed:
    """Subscribes to one worker's events and keeps its `KVBlockIndex`."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str, topic: str) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.index = KVBlockIndex()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.asyncio.Context.instance()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._catching_up: asyncio.Task[None] | None = None
        self._sub_seq = -1  # the last sequence the SUB socket delivered
        self.epoch = ""  # the publisher's, from the load reports

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        for task in (self._task, self._catching_up):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._catching_up = None

    def reported(self, published: int, epoch: str = "") -> None:
        """A load report says the worker's publisher (`epoch`) has published `published`
        batches. Another epoch: the engine restarted, the index starts over. Still behind a
        count an earlier report gave: the last ones were lost (no later batch shows the gap), so
        they are asked for."""
        index = self.index
        if epoch != self.epoch:
            if self.epoch:
                logger.warning("kv events from %s: a new publisher (its engine restarted)", self.name)
                index.reset()
                self._sub_seq = -1
            self.epoch = epoch
        if published <= index.last_seq + 1:
            index.behind_since = None
        elif index.behind_since is None:
            index.behind_since = published  # may still be on its way; next report decides
        elif index.last_seq + 1 < index.behind_since and self._catching_up is None:
            self._catching_up = asyncio.get_running_loop().create_task(self._catch_up())

    async def _catch_up(self) -> None:
        try:
            async with self._lock:
                await self._replay_from(self.index.last_seq + 1, None)
        except Exception as e:  # (zmq errors: the next report asks again)
            logger.warning("kv events from %s: catching up failed: %s", self.name, e)
            self.index.complete = False
        finally:
            self._catching_up = None

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                async with self._lock:
                    try:
                        await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
                    except Exception as e:  # the feed goes on; the index is not exact now
                        logger.warning("kv events from %s: %s", self.name, e)
                        self.index.complete = False
        finally:
            sub.close(linger=0)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        index = self.index
        if seq <= self._sub_seq:
            logger.warning("kv events from %s start over at %d (was %d): its engine restarted",
                           self.name, seq, self._sub_seq)
            index.reset()
        self._sub_seq = seq
        if seq <= index.last_seq:
            return  # a replay applied it already
        if seq > index.last_seq + 1:
            await self._replay_from(index.last_seq + 1, seq)
            if index.last_seq + 1 != seq:
                index.complete = False  # the replay buffer no longer had them
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("kv events from %s: undecodable batch %d (%s)", self.name, seq, e)
            self.index.complete = False
            self.index.last_seq = seq
            return
        self.index.apply(seq, batch)

    async def _replay_from(self, first: int, until: int | None) -> None:
        """Applies the kept batches from `first` (below `until`); a missing one leaves the index
        incomplete."""
        if not self.replay_endpoint:
            self.index.complete = False
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # (a replay may be thousands of batches)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    logger.warning("kv events from %s: replay from %d timed out", self.name, first)
                    self.index.complete = False
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return
                if until is not None and seq >= until:
                    continue
                if seq > self.index.last_seq:
                    if seq != self.index.last_seq + 1:
                        self.index.complete = False
                    self._apply(seq, frames[2])
        finally:
            dealer.close(linger=0)


def subscriber_address(endpoint: str, worker_target: str) -> str:
    """A reported PUB / replay address as this router reaches it: a wildcard host (`*`, 0.0.0.0,
    `::`) is the worker's own host (from its gRPC target)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        worker_host = worker_target.rpartition(":")[0] or "127.0.0.1"
        return f"tcp://{worker_host}:{port}"
    return endpoint
