"""`kv_events_config`, in vLLM's JSON form: whether the engine publishes its KV cache events, and
where.

vLLM's keys: `enable_kv_cache_events`, `publisher` ("zmq" or "null"; "zmq" when events are on and
none is named), `endpoint` (the PUB socket, default `tcp://*:5557`), `replay_endpoint` (a ROUTER
socket answering replay requests; default none), `buffer_steps` (batches kept for replay),
`hwm` (the PUB socket's high-water mark), `max_queue_size` (batches waiting for the publisher
thread) and `topic` (the first frame of every message).

vLLM binds an endpoint with a wildcard host (`*`, `::`) or an ipc/inproc one and connects any
other (to a subscriber that binds, as llm-d's does). pdserve's own key `bind` (true / false)
overrides that guess: `pdserve up` binds `tcp://127.0.0.1:P`, so its events stay on the host
(they carry prompt token ids; see docs/kv-events.md). A key this engine does not read is
refused with its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.json_config import json_object

_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
         "hwm", "max_queue_size", "topic", "bind")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are on, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # pdserve's: None = vLLM's guess from the endpoint

    def __post_init__(self) -> None:
        _check(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events",
               f"must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check(self.publisher in ("zmq", "null"), "publisher",
               f"must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            _check(isinstance(value, str) and value.startswith(_SCHEMES), name,
                   f"must be a ZMQ address (tcp://host:port, ipc://path or inproc://name), got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                   f"must be a positive integer, got {value!r}")
        _check(isinstance(self.topic, str), "topic", f"must be a string, got {self.topic!r}")
        _check(self.bind is None or isinstance(self.bind, bool), "bind",
               f"must be true, false or null, got {self.bind!r}")

    @property
    def publishing(self) -> bool:
        """Events on and a real publisher: the engine records and sends them."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds `endpoint` (else it connects to a subscriber that binds)."""
        if self.bind is not None:
            return self.bind
        e = self.endpoint
        return "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From vLLM's forms: a dict, its JSON text, or None (off)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**json_object(value, "kv_events_config", _KEYS))


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"kv_events_config.{field_name}: {message}")
