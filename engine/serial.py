"""Typed messages between the front end and an engine-core process (msgspec msgpack, no pickle).

A message is two ZMQ frames: its kind (bytes) and its msgpack payload. Each kind has one type;
decoding checks the payload against it.

front end -> core: ADD (EngineCoreRequest), ABORT (list of request ids), FIRST_TOKEN
(FirstToken: the prefill's first token of a request added with await_first_token), GET_STATS
(None), SHUTDOWN (None).
core -> front end: READY (ReadyInfo, once the model is loaded), FAILED (CoreFailure, start-up
failed), OUTPUTS (EngineCoreOutputs), STATS (EngineStats, the answer to GET_STATS), HEARTBEAT
(float: seconds the step under way has run, 0 between steps; sent every HEARTBEAT_S by a thread
of its own, so a front end that hears none knows the core is frozen or gone, and one that hears
a growing number knows a step is stuck).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from engine.core.outputs import EngineCoreOutputs, EngineCoreRequest, EngineStats, FirstToken

ADD = b"add"
ABORT = b"abort"
FIRST_TOKEN = b"first_token"
GET_STATS = b"get_stats"
SHUTDOWN = b"shutdown"
READY = b"ready"
FAILED = b"failed"
OUTPUTS = b"outputs"
STATS = b"stats"
HEARTBEAT = b"heartbeat"
HEARTBEAT_S = 0.5
POLL_MS = 100  # how long a socket reader waits for a message before checking on the other side


@dataclass
class ReadyInfo:
    """Sent once by the core process after the model loaded and the KV cache was sized."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    stats: EngineStats


@dataclass
class CoreFailure:
    """Why the core process could not start (the exception's type name and message)."""

    error_type: str
    message: str


_PAYLOAD_TYPES: dict[bytes, Any] = {
    ADD: EngineCoreRequest,
    ABORT: list[str],
    FIRST_TOKEN: FirstToken,
    GET_STATS: None,
    SHUTDOWN: None,
    READY: ReadyInfo,
    FAILED: CoreFailure,
    OUTPUTS: EngineCoreOutputs,
    STATS: EngineStats,
    HEARTBEAT: float,
}


class MessageCodec:
    """Encodes (kind, payload) into frames and back, checking payload types."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in _PAYLOAD_TYPES.items()}

    def encode(self, kind: bytes, payload: Any = None) -> list[bytes]:
        if kind not in _PAYLOAD_TYPES:
            raise ValueError(f"unknown message kind {kind!r}")
        return [kind, self._encoder.encode(payload)]

    def decode(self, frames: list[bytes]) -> tuple[bytes, Any]:
        if len(frames) != 2 or frames[0] not in self._decoders:
            raise ValueError(f"malformed message: {len(frames)} frames, kind {frames[:1]!r}")
        kind = bytes(frames[0])
        return kind, self._decoders[kind].decode(frames[1])
