"""The ZMQ publisher: a PUB socket for every batch, and a ROUTER socket that replays missed ones.

Each message is three frames, as vLLM's: the topic, the batch's sequence number (8 bytes,
big-endian, from 0 with no gaps), the msgpack batch. The last `buffer_steps` batches are kept;
a subscriber that sees a gap sends the first sequence it missed (8 bytes, big-endian) on a REQ
socket to the replay endpoint and gets back every kept batch from there as (sequence, payload)
messages, then (-1, b"") to end the reply. A thread encodes and sends, so a step only queues its events (and
costs one `if` when events are off).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import deque

import msgspec
import zmq

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.events import Event, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SHUTDOWN_S = 2.0


class ZmqEventPublisher:
    """Publishes the engine's event batches on `config.endpoint` (and replays on
    `config.replay_endpoint`) from a thread of its own. Sockets are opened here, so a port in
    use fails the engine's start."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if config.binds:
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a whole buffer and its end marker in one reply (the default 1,000 would drop)
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 2)
                self._replay.bind(config.replay_endpoint)
            # where a subscriber finds them ("" when connecting out): a port given as "*" is
            # the one the system chose
            self.endpoint = _bound(self._pub) if config.binds else ""
            self.replay_endpoint = "" if self._replay is None else _bound(self._replay)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"kv_events_config: cannot open {e.strerror.lower()}: "
                          f"{config.endpoint} / {config.replay_endpoint}") from None
        self.epoch = uuid.uuid4().hex  # this publisher's: its sequence numbers start at 0
        self.next_seq = 0  # numbered when published: a batch the full queue refused is a gap
        self.dropped = 0  # batches the full queue refused
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queues one batch (a step's events); never blocks the engine."""
        if not events or not self._running:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self._queue.put_nowait((seq, KVEventBatch(ts=time.time(), events=events,
                                                      data_parallel_rank=self._rank)))
        except queue.Full:
            self.dropped += 1

    def shutdown(self) -> None:
        """Sends what is queued (for up to 2 s), then closes the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=_SHUTDOWN_S)
        self._thread.join(_SHUTDOWN_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as e:
                    logger.warning("kv events: replay request failed: %s", e)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            payload = encoder.encode(batch)
            self._buffer.append((seq, payload))  # (replayable even when the send fails)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:  # (a full PUB queue drops silently; this is a closed socket)
                logger.warning("kv events: publishing failed: %s", e)
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            if len(frames) >= 2:  # a REQ peer waits for an answer: the end marker at once
                self._replay.send_multipart((frames[0], b"", END_SEQ, b""))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bound(sock: zmq.Socket) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
