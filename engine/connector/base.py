"""The two halves of a KV connector and the plain messages between them (vLLM's
KVConnectorBase_V1; docs/architecture.md, "The KV connector's contract").

Scheduler half (inside the scheduler; no tensors, no torch):
- `get_num_new_matched_tokens(request, num_computed)` -> (tokens available outside beyond the
  locally computed ones, or None = "ask again later"; whether they load asynchronously).
- `update_state_after_alloc(request, block_ids, num_external_tokens)` after blocks exist.
- `build_connector_meta(scheduler_output)` -> what the worker half does this step.
- `request_finished(request, block_ids)` -> (delay freeing the blocks?, kv_transfer_params).
- `update_connector_output(output)` with what the worker half finished.
- optionally `on_first_token(request, kv_transfer_params)` (an early hand-off's first token came)
  and `cancel_load(req_id)` (an aborted request's load should stop waiting).

Worker half (around the forward pass): `register_kv_caches`, `bind_connector_metadata`,
`start_load_kv`, `wait_for_layer_load(layer)`, `save_kv_layer(layer, kv_cache)`,
`wait_for_save`, `get_finished(finished_ids)`, `clear_connector_metadata`; optionally
`get_transfer_stats()` (load / save times and bytes, for metrics).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.outputs import KVTransferStats, SchedulerOutput
    from engine.core.request import Request


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step (plain ids and counts)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # request id -> tokens that loaded correctly, from the start (load failures only)
    valid_loaded_tokens: dict[str, int] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    # request id -> (bytes, seconds) of its KV loaded / saved (saves: in this step), for traces
    load_stats: dict[str, tuple[int, float]] = field(default_factory=dict)
    save_stats: dict[str, tuple[int, float]] = field(default_factory=dict)

    def merge(self, other: KVConnectorOutput) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.valid_loaded_tokens.update(other.valid_loaded_tokens)
        self.load_errors.update(other.load_errors)
        self.load_stats.update(other.load_stats)
        for req_id, (nbytes, seconds) in other.save_stats.items():
            had = self.save_stats.get(req_id, (0, 0.0))
            self.save_stats[req_id] = (had[0] + nbytes, max(had[1], seconds))


class KVConnectorScheduler(abc.ABC):
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None: ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    @abc.abstractmethod
    def request_finished(self, request: Request,
                         block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Optional: bookkeeping on what the worker half finished."""

    def on_first_token(self, request: Request,  # noqa: B027
                       kv_transfer_params: dict[str, Any] | None) -> None:
        """Optional: a request that awaited its prefill's first token got it, and the
        producer's kv_transfer_params (already checked against the request's tokens)."""

    def cancel_load(self, req_id: str) -> None:  # noqa: B027
        """Optional: the request, whose asynchronous load is under way, was aborted: a load
        that waits for objects still to come stops (it reports finished as usual)."""

    def shutdown(self) -> None:  # noqa: B027
        """Optional: stop background threads."""


class KVConnectorWorker(abc.ABC):
    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: list[Any],
                           layer_group: list[int] | None = None) -> None:
        """Per layer its cache, and (hybrid models) its KV cache group: the index into the
        per-group block ids of the requests (None: one group)."""

    @abc.abstractmethod
    def bind_connector_metadata(self, metadata: Any) -> None: ...

    @abc.abstractmethod
    def start_load_kv(self) -> None: ...

    @abc.abstractmethod
    def wait_for_layer_load(self, layer: int) -> None: ...

    @abc.abstractmethod
    def save_kv_layer(self, layer: int, kv_cache: Any) -> None: ...

    @abc.abstractmethod
    def wait_for_save(self) -> None: ...

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput: ...

    @abc.abstractmethod
    def clear_connector_metadata(self) -> None: ...

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:  # noqa: B027
        """Optional: call `wakeup()` when an asynchronous load finishes."""

    def get_transfer_stats(self) -> KVTransferStats | None:
        """Optional: a snapshot of the KV moved so far (safe to call while transfers run)."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        """Optional: stop background threads."""
