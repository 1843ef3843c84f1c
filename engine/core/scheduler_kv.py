"""The scheduler's side of a KV connector: requests whose KV arrives from outside, loads that
fail, and freeing a request through the connector (engine/core/scheduler.py inherits this).

Its tables, by request id: `waiting_for_kv` (an asynchronous load under way; the request holds
its blocks), `_aborted_loading` (aborted while loading: blocks freed once the load stops),
`_kv_loaded` (loaded, waiting to run), `_loading_in_step` (a layer-wise load inside this step),
`_load_end` (where an asynchronous load ends), `_rollback` (this step ran over KV that failed to
load: discard it), `_no_external` (recompute without the connector), `_failed_outputs`
(final outputs of requests failed here, sent with the step's), and `_awaiting_token` (requests
dispatched beside their prefill, parked until its first token comes: out of the queue with no
load to start, or loaded, with their load's outcome in `_loaded_awaiting`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.block_pool import KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, tokens_left
from engine.core.request_stats import SchedulerCounters

if TYPE_CHECKING:
    from engine.connector.base import KVConnectorOutput, KVConnectorScheduler

logger = logging.getLogger(__name__)


@dataclass
class WaitingStep:
    """What one step's scheduling of the waiting queue carries from request to request."""

    budget: int
    num_scheduled: dict[str, int]
    new_blocks: dict[str, list[list[int]]]
    resumed: set[str]
    now: float


class KVLoads:
    """Connector bookkeeping of a Scheduler (which owns the attributes declared here)."""

    kv: KVCacheManager
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    counters: SchedulerCounters
    _known_by_runner: set[str]
    _finished_for_runner: set[str]

    def __init__(self, connector: KVConnectorScheduler | None, load_failure_policy: str) -> None:
        self.connector = connector
        self.load_failure_policy = load_failure_policy
        self.waiting_for_kv: dict[str, Request] = {}
        self._aborted_loading: dict[str, Request] = {}
        self._kv_loaded: set[str] = set()
        self._failed_outputs: list[EngineCoreOutput] = []
        self._loading_in_step: set[str] = set()
        self._rollback: set[str] = set()
        self._no_external: set[str] = set()
        self._load_end: dict[str, int] = {}
        self._awaiting_token: dict[str, Request] = {}
        self._loaded_awaiting: dict[str, tuple[str | None, int | None]] = {}  # (error, valid end)

    # The Scheduler's own (engine/core/scheduler.py)
    def _num_new_tokens(self, request: Request, budget: int, computed: int | None = None) -> int:
        raise NotImplementedError

    def _sjf_holds_back(self, num_scheduled: dict[str, int], n: int, left: int) -> bool:
        raise NotImplementedError

    def _start_running(self, request: Request, n: int, num_scheduled: dict[str, int],
                       new_blocks: dict[str, list[list[int]]]) -> int:
        raise NotImplementedError


    def _start_loaded(self, request: Request, step: WaitingStep) -> int | None:
        """A request whose asynchronous KV load finished: it computes the rest."""
        n = self._num_new_tokens(request, step.budget)
        if self._sjf_holds_back(step.num_scheduled, n, tokens_left(request)):
            return None
        if self.kv.allocate_slots(request, n) is None:
            return 0 if self._drop_loaded(request) else None
        self._kv_loaded.discard(request.request_id)
        request.times.first_scheduled_time = request.times.first_scheduled_time or step.now
        return self._start_running(request, n, step.num_scheduled, step.new_blocks)

    def _start_loading(self, request: Request, hits: list[list[KVCacheBlock]], num_hit_tokens: int,
                       num_external: int, load_async: bool, step: WaitingStep) -> int | None:
        """`num_external` tokens after the hits come from the connector: asynchronously (the
        request waits for them out of the step) or layer-wise (inside this step, which computes
        the rest)."""
        loaded = num_hit_tokens + num_external
        n = 0 if load_async else self._num_new_tokens(request, step.budget, loaded)
        if not load_async and self._sjf_holds_back(step.num_scheduled, n, request.num_tokens - loaded):
            return None
        if self.kv.allocate_slots(request, num_external + n, num_hit_tokens, hits, cache=False,
                                  num_external_tokens=num_external) is None:
            return 0 if self._drop_loaded(request) else None
        if load_async:
            self.waiting.pop()
            self.kv.record_lookup(request, num_hit_tokens)
            self._load_end[request.request_id] = loaded
            request.num_computed_tokens = num_hit_tokens
            request.times.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_kv[request.request_id] = request
            self._after_alloc(request, num_external)
            return 0
        if not self._after_alloc(request, num_external):
            return 0
        self.kv.record_lookup(request, num_hit_tokens)
        request.times.first_scheduled_time = step.now
        request.times.num_cached_tokens = loaded
        request.num_computed_tokens = loaded
        self._loading_in_step.add(request.request_id)
        return self._start_running(request, n, step.num_scheduled, step.new_blocks)

    def _after_alloc(self, request: Request, num_external: int) -> bool:
        """Tells the connector where the request's external tokens go. A failure there (bad
        request data) fails the request, whose blocks are freed: False."""
        assert self.connector is not None
        try:
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), num_external)
        except Exception as e:
            self._fail(request, f"kv connector: {e!r}")
            return False
        return True

    def _drop_loaded(self, head: Request) -> bool:
        """The head of the queue does not fit: free the blocks of a request whose KV arrived but
        which is not running yet (another one first; the head itself only when nothing runs).
        Its loaded KV stays in the prefix cache, so recomputing it mostly hits. Without this,
        loaded requests holding blocks in the queue could block each other forever."""
        others = [r for r in self._kv_loaded if r != head.request_id]
        if others:
            victim = self.requests[others[-1]]
        elif head.request_id in self._kv_loaded and not self.running:
            victim = head
        else:
            return False
        self._kv_loaded.discard(victim.request_id)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        return True

    def update_connector_output(self, output: KVConnectorOutput | None) -> None:
        """Requests whose KV finished arriving go back to the waiting queue's head (or fail)."""
        if output is None or self.connector is None:
            return
        self.connector.update_connector_output(output)
        now = time.time()
        for req_id, (nbytes, seconds) in output.load_stats.items():
            if (loading := self.requests.get(req_id)) is not None:
                loading.times.kv_load_bytes += nbytes
                loading.times.kv_load_seconds += seconds
                loading.times.kv_load_end_time = now
        for req_id, (nbytes, seconds) in output.save_stats.items():
            if (saving := self.requests.get(req_id)) is not None:
                saving.times.kv_save_bytes += nbytes
                saving.times.kv_save_seconds += seconds
                saving.times.kv_save_end_time = now
        for req_id in output.finished_recving & self._loading_in_step:
            self._loading_in_step.discard(req_id)
            request = self.requests.get(req_id)
            error = output.load_errors.get(req_id)
            if request is None or error is None:
                if request is not None:
                    self.kv.cache_blocks(request, request.num_computed_tokens)
                continue
            if self.load_failure_policy == "fail":
                self._fail(request, f"kv_load_failed: {error}")
            else:  # the step computed over bad KV: drop its token and recompute everything
                self._rollback.add(req_id)
        for req_id in output.finished_recving - self._loading_in_step:
            aborted = self._aborted_loading.pop(req_id, None)
            if aborted is not None:
                self._free(aborted)
                continue
            request = self.waiting_for_kv.pop(req_id, None)
            if request is None:
                continue
            outcome = (output.load_errors.get(req_id), output.valid_loaded_tokens.get(req_id))
            if request.awaiting_first_token:  # loaded before its prefill ended: parked
                self._awaiting_token[req_id] = request
                self._loaded_awaiting[req_id] = outcome
                continue
            self._finish_load(request, *outcome)

    def _finish_load(self, request: Request, error: str | None, valid: int | None) -> None:
        """An asynchronous load ended (`valid`: where its valid KV ends, when short): the
        request goes to the queue's head with its blocks, to compute the rest (or fails)."""
        req_id = request.request_id
        if error is not None and self.load_failure_policy == "fail":
            self._load_end.pop(req_id, None)
            self._fail(request, f"kv_load_failed: {error}")
            return
        planned = min(request.num_tokens - 1, self._load_end.pop(req_id, 0))
        loaded_end = planned if valid is None else min(planned, valid)
        if loaded_end < planned and self.kv.window_has_null_blocks(request.request_id, loaded_end):
            # A windowed load cut short: the tokens to compute now would see positions in
            # the blocks the window let it skip (never allocated): start again, locally.
            self.kv.free(request)
            request.num_computed_tokens = 0
            self._no_external.add(req_id)
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)
            return
        request.num_computed_tokens = max(request.num_computed_tokens, loaded_end)
        request.times.num_cached_tokens = request.num_computed_tokens
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self._kv_loaded.add(req_id)
        self.waiting.prepend(request)

    # --- early hand-off: a request that awaits its prefill's first token ------------------
    def _park(self, request: Request) -> int:
        """The queue's head awaits its first token and has no load to start (none offered,
        or one already done): out of the queue until the token comes."""
        self.waiting.pop()
        self._awaiting_token[request.request_id] = request
        return 0

    def add_first_token(self, req_id: str, token_id: int,
                        kv_transfer_params: dict[str, Any] | None) -> bool:
        """The prefill's first token of a request added with await_first_token: it becomes a
        prior output and the request is computed from there (at once when its KV is in).
        False (nothing done) for a request not known here, finished, or not awaiting a token."""
        request = self.requests.get(req_id)
        if request is None or request.is_finished or not request.awaiting_first_token:
            return False
        request.add_first_token(token_id)
        if self.connector is not None:  # the producer's keys, for the release (checked at the edge)
            self.connector.on_first_token(request, kv_transfer_params)
        if self._awaiting_token.pop(req_id, None) is not None:
            outcome = self._loaded_awaiting.pop(req_id, None)
            if outcome is None:
                self.waiting.prepend(request)
            else:
                self._finish_load(request, *outcome)
        return True

    def _end_awaiting(self, request: Request) -> bool:
        """Frees a parked request being ended (an abort); False when it is not parked."""
        if self._awaiting_token.pop(request.request_id, None) is None:
            return False
        self._loaded_awaiting.pop(request.request_id, None)
        self._load_end.pop(request.request_id, None)
        return True

    def _fail(self, request: Request, reason: str) -> None:
        """Ends one request now, with `reason` as its stop reason (a KV load that failed under
        the "fail" policy, or a connector call that failed on its data): it is taken out of
        running / waiting, its blocks are freed and its consumer gets a final "abort" output."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = reason
        request.times.finished_time = time.time()
        self.counters.on_finished(request)
        self._free(request)
        self._failed_outputs.append(EngineCoreOutput(
            request.request_id, [], finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason, times=request.times))

    def _roll_back(self, request: Request) -> None:
        """Undo a step computed over KV that failed to load: free the blocks (never cached)
        and queue the request first, to be computed from scratch without the connector."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._no_external.add(request.request_id)
        # The runner forgets it (as if the step never ran).
        self._known_by_runner.discard(request.request_id)
        self._finished_for_runner.add(request.request_id)
        self.waiting.prepend(request)

    def _free(self, request: Request) -> None:
        if self.connector is not None:
            try:
                _, request.kv_transfer_params = self.connector.request_finished(
                    request, self.kv.get_block_ids(request.request_id))
            except Exception as e:  # the request ends either way; its KV is not handed on
                logger.warning("kv connector: request_finished(%s) failed: %r", request.request_id, e)
                request.kv_transfer_params = None
        self._kv_loaded.discard(request.request_id)
        self._no_external.discard(request.request_id)
        self._loading_in_step.discard(request.request_id)
        self._load_end.pop(request.request_id, None)
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._known_by_runner:
            self._known_by_runner.discard(request.request_id)
            self._finished_for_runner.add(request.request_id)
