"""The scheduler: who computes how many tokens each step (pure Python, no tensors).

There are no prefill or decode phases: every step gives each running request, then waiting
requests, new tokens up to the token budget, so `num_computed_tokens` catches up with
`num_tokens`. Long prompts are chunked by the budget. When blocks run out, the most recently
started running request (or the lowest-priority one) is preempted: its blocks are freed and it
goes back to the head of the waiting queue, to be recomputed.

Under the "sjf" policy, running requests are ordered by tokens left, and a chunked prefill
with more tokens left than the waiting queue's head (and not yet waiting `sjf_max_wait_s`)
takes what budget the waiting requests leave: shortest remaining prefill first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsEntry,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import ShortestFirstQueue, make_queue, tokens_left
from engine.core.request_stats import SchedulerCounters
from engine.core.stop_check import check_stop

if TYPE_CHECKING:
    from engine.connector.base import KVConnectorOutput, KVConnectorScheduler

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None) -> None:
        self.max_model_len = config.model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_threshold = config.long_prefill_token_threshold
        self.policy = config.scheduling_policy
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy, config.sjf_max_wait_s)
        self.running: list[Request] = []
        self._finished_for_runner: set[str] = set()
        self._known_by_runner: set[str] = set()
        self.connector = connector
        self.load_failure_policy = config.kv_load_failure_policy
        # Requests whose KV is arriving from the connector (they hold their blocks), and
        # aborted ones whose blocks wait for their load to stop before they are freed.
        self.waiting_for_kv: dict[str, Request] = {}
        self._aborted_loading: dict[str, Request] = {}
        self._kv_loaded: set[str] = set()
        self._failed_outputs: list[EngineCoreOutput] = []
        self._loading_in_step: set[str] = set()  # layer-wise loads under way in this step
        self._rollback: set[str] = set()  # their load failed: discard the step, recompute
        self._no_external: set[str] = set()  # recompute these without the connector
        self._load_end: dict[str, int] = {}  # async loads: tokens computed once the load is in
        self.counters = SchedulerCounters.create(config.model_len)

    # --- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends the given unfinished requests (e.g. aborts); unknown ids are ignored."""
        ended = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_kv[req_id]
                request.status = status
                self._aborted_loading[req_id] = request  # blocks freed once the load stops
                ended.append(request)
                continue
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def has_unfinished_requests(self) -> bool:
        return (bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_kv)
                or bool(self._aborted_loading))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        now = time.time()

        deferred = self._sjf_deferred(now) if isinstance(self.waiting, ShortestFirstQueue) else set()
        budget = self._schedule_running(budget, num_scheduled, new_blocks, preempted, deferred)
        resumed: set[str] = set()
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_blocks, resumed, now)
            if deferred and budget > 0:
                self._schedule_running(budget, num_scheduled, new_blocks, preempted, only=deferred)
        out = self._build_output(num_scheduled, new_blocks, resumed, preempted)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return out

    def _num_new_tokens(self, request: Request, budget: int, computed: int | None = None) -> int:
        """Tokens to compute this step, counting from `computed` (default: those computed)."""
        n = request.num_tokens - (request.num_computed_tokens if computed is None else computed)
        if 0 < self.long_prefill_threshold < n:
            n = self.long_prefill_threshold
        return min(n, budget)

    def _sjf_deferred(self, now: float) -> set[str]:
        """Orders running requests by tokens left; returns the chunked prefills that wait for
        the shorter waiting requests this step (never decodes, never one waiting too long)."""
        assert isinstance(self.waiting, ShortestFirstQueue)
        self.running.sort(key=tokens_left)  # stable; preemption takes the longest first
        if len(self.waiting) == 0:
            return set()
        head = self.waiting.peek()
        limit = 1 if self.waiting.is_aged(head, now) else max(tokens_left(head), 1)
        return {r.request_id for r in self.running
                if tokens_left(r) > limit and not self.waiting.is_aged(r, now)}

    def _sjf_holds_back(self, num_scheduled: dict[str, int], n: int, left: int) -> bool:
        """sjf: once a step holds a prefill, another joins it only if it completes in it. A
        prefill is compute-bound: a second one's chunk would only make the first finish later."""
        return (isinstance(self.waiting, ShortestFirstQueue) and n < left
                and any(k > 1 for k in num_scheduled.values()))

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], preempted: list[Request],
                          skip: set[str] | frozenset[str] = frozenset(),
                          only: set[str] | None = None) -> int:
        """Schedules running requests in order (those in `skip` not, or only those in `only`).
        The `only` pass (sjf's deferred prefills) never preempts a request this step scheduled,
        the requests just taken from the waiting queue included: it leaves its own for later."""
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            if (request.request_id in skip or request.request_id in num_scheduled
                    or (only is not None and request.request_id not in only)):
                idx += 1
                continue
            n = self._num_new_tokens(request, budget)
            if n == 0:
                idx += 1
                continue
            if self._sjf_holds_back(num_scheduled, n, tokens_left(request)):
                idx += 1
                continue
            held = False  # not preempted either: waits for the next step
            while True:
                blocks = self.kv.allocate_slots(request, n)
                if blocks is not None:
                    break
                if only is not None and self.running[-1].request_id in num_scheduled:
                    held = True  # the next victim was scheduled in this step
                    break
                victim = self._preempt_one()
                preempted.append(victim)
                if victim is request:
                    break
                if victim.request_id in num_scheduled:  # priority policy: already scheduled
                    budget += num_scheduled.pop(victim.request_id)
                    del new_blocks[victim.request_id]
                    idx -= 1
            if blocks is None:
                if held:
                    break
                continue  # the request itself was preempted
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            budget -= n
            idx += 1
        return budget

    def _preempt_one(self) -> Request:
        if self.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.times.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.times.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.prepend(victim)
        return victim

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], resumed: set[str], now: float) -> int:
        while (len(self.waiting) > 0 and budget > 0
               and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs):
            request = self.waiting.peek()
            if request.request_id in self._kv_loaded:  # its blocks and loaded KV are in place
                n = self._num_new_tokens(request, budget)
                if self._sjf_holds_back(num_scheduled, n, tokens_left(request)):
                    break
                if self.kv.allocate_slots(request, n) is None:
                    if self._drop_loaded(request):
                        continue
                    break
                self._kv_loaded.discard(request.request_id)
                request.times.first_scheduled_time = request.times.first_scheduled_time or now
                budget -= self._start_running(request, n, num_scheduled, new_blocks)
                continue
            # prompt_logprobs need every prompt position computed here (as vLLM: no cache hits)
            computes_all = request.sampling_params.prompt_logprobs is not None
            hits, num_hit_tokens = ([], 0) if computes_all else self.kv.get_computed_blocks(request)
            if (self.connector is not None and request.status == RequestStatus.WAITING
                    and request.request_id not in self._no_external and not computes_all):
                try:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_hit_tokens)
                except Exception as e:  # bad request data: that request fails, the engine goes on
                    self._fail(request, f"kv connector: {e!r}")
                    continue
                if num_external is None:
                    break
                if load_async and num_external > 0:
                    if self.kv.allocate_slots(request, num_external, num_hit_tokens, hits,
                                              cache=False) is None:
                        if self._drop_loaded(request):
                            continue
                        break
                    self.waiting.pop()
                    self.kv.record_lookup(request, num_hit_tokens)
                    self._load_end[request.request_id] = num_hit_tokens + num_external
                    request.num_computed_tokens = num_hit_tokens
                    request.times.num_cached_tokens = num_hit_tokens
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.waiting_for_kv[request.request_id] = request
                    self._after_alloc(request, num_external)
                    continue
                if num_external > 0:
                    # Layer-wise load inside this step: the runner computes only the rest.
                    loaded = num_hit_tokens + num_external
                    n = self._num_new_tokens(request, budget, loaded)
                    if self._sjf_holds_back(num_scheduled, n, request.num_tokens - loaded):
                        break
                    if self.kv.allocate_slots(request, num_external + n, num_hit_tokens, hits,
                                              cache=False) is None:
                        if self._drop_loaded(request):
                            continue
                        break
                    if not self._after_alloc(request, num_external):
                        continue
                    self.kv.record_lookup(request, num_hit_tokens)
                    request.times.first_scheduled_time = now
                    request.times.num_cached_tokens = loaded
                    request.num_computed_tokens = loaded
                    self._loading_in_step.add(request.request_id)
                    budget -= self._start_running(request, n, num_scheduled, new_blocks)
                    continue
            n = self._num_new_tokens(request, budget, num_hit_tokens)
            if self._sjf_holds_back(num_scheduled, n, request.num_tokens - num_hit_tokens):
                break
            if self.kv.allocate_slots(request, n, num_hit_tokens, hits) is None:
                if self._drop_loaded(request):
                    continue
                break
            if request.status == RequestStatus.PREEMPTED:
                resumed.add(request.request_id)
            else:
                request.times.first_scheduled_time = now
                request.times.num_cached_tokens = num_hit_tokens
            self.kv.record_lookup(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            budget -= self._start_running(request, n, num_scheduled, new_blocks)
        return budget

    def _start_running(self, request: Request, n: int, num_scheduled: dict[str, int],
                       new_blocks: dict[str, list[int]]) -> int:
        """Moves the waiting queue's head, whose blocks are allocated, to running with `n` new
        tokens this step; returns `n`."""
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        num_scheduled[request.request_id] = n
        new_blocks[request.request_id] = self.kv.get_block_ids(request.request_id)
        return n

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

    def _build_output(self, num_scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                      resumed: set[str], preempted: list[Request]) -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for req_id, _n in num_scheduled.items():
            request = self.requests[req_id]
            if req_id not in self._known_by_runner or req_id in resumed:
                self._known_by_runner.add(req_id)
                new_reqs.append(NewRequestData(
                    req_id, list(request.all_token_ids), request.num_prompt_tokens,
                    request.sampling_params, new_blocks[req_id], request.num_computed_tokens))
            else:
                cached_reqs.append(CachedRequestData(
                    req_id, new_blocks[req_id], request.num_computed_tokens))
        finished, self._finished_for_runner = self._finished_for_runner, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in preempted},
        )

    # --- results of a step ---------------------------------------------------------------
    def update_connector_output(self, output: KVConnectorOutput | None) -> None:
        """Requests whose KV finished arriving go back to the waiting queue's head (or fail)."""
        if output is None or self.connector is None:
            return
        self.connector.update_connector_output(output)
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
            error = output.load_errors.get(req_id)
            if error is not None and self.load_failure_policy == "fail":
                self._fail(request, f"kv_load_failed: {error}")
                continue
            loaded_end = min(request.num_tokens - 1, self._load_end.pop(req_id, 0))
            if req_id in output.valid_loaded_tokens:
                loaded_end = min(loaded_end, output.valid_loaded_tokens[req_id])
            request.num_computed_tokens = max(request.num_computed_tokens, loaded_end)
            request.times.num_cached_tokens = request.num_computed_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            self._kv_loaded.add(req_id)
            self.waiting.prepend(request)

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

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        now = time.time()
        self.update_connector_output(runner_output.kv_connector_output)
        outputs, self._failed_outputs = self._failed_outputs, []
        logprobs = runner_output.logprobs or [None] * len(runner_output.req_ids)
        for req_id, token_ids, lp in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                         logprobs, strict=False):
            request = self.requests.get(req_id)
            if req_id in self._rollback and request is not None:
                self._rollback.discard(req_id)
                self._roll_back(request)
                continue
            if request is not None and req_id in runner_output.prompt_logprobs:
                _keep_prompt_logprobs(request, *runner_output.prompt_logprobs[req_id])
            if not token_ids or request is None or request.is_finished:
                continue
            first = request.num_new_output_tokens == 0
            self.counters.on_tokens(request, len(token_ids), now)
            request.append_output_token_ids(token_ids)
            out = EngineCoreOutput(req_id, list(token_ids), [lp] if lp is not None else None)
            if first and request.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = list(request.prompt_logprobs)
            if check_stop(request, self.max_model_len):
                self.running.remove(request)
                self._free(request)
                request.times.finished_time = now
                self.counters.on_finished(request)
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
                out.times = request.times
                out.kv_transfer_params = request.kv_transfer_params
            outputs.append(out)
        self.counters.end_step()
        return EngineCoreOutputs(outputs=outputs, timestamp=now)

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


def _keep_prompt_logprobs(request: Request, start: int, entries: list[LogprobsEntry]) -> None:
    """Appends a step's prompt logprobs (entries[k] for prompt token start + 1 + k), skipping
    positions already kept (a preempted or rolled-back request computes them again)."""
    have = len(request.prompt_logprobs)
    if start <= have:
        request.prompt_logprobs.extend(entries[have - start:])
