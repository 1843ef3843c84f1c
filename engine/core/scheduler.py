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
from engine.core.block_pool import KVCacheBlock
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
from engine.core.scheduler_fsm import GrammarWaits
from engine.core.scheduler_kv import KVLoads, WaitingStep
from engine.core.scheduler_spec import SpecSchedule

if TYPE_CHECKING:
    from engine.connector.base import KVConnectorScheduler

logger = logging.getLogger(__name__)
# A request awaiting its prefill's first token takes blocks for its early load only while the
# cache is less used than this: under pressure the blocks go to requests that can run, and it
# loads once its token came (as a plain hand-off).
EARLY_MAX_KV_USAGE = 0.75


class Scheduler(KVLoads, GrammarWaits, SpecSchedule):
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
        self.counters = SchedulerCounters.create(config.model_len)
        KVLoads.__init__(self, connector, config.kv_load_failure_policy)
        GrammarWaits.__init__(self)
        SpecSchedule.__init__(self, config.speculative_config)

    # --- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._queue(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends the given unfinished requests (e.g. aborts); unknown ids are ignored."""
        ended = []
        for req_id in request_ids:
            self._trimmed.pop(req_id, None)
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self._drop_fsm_wait(request) or self._end_awaiting(request):
                pass
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_kv[req_id]
                request.status = status
                self._aborted_loading[req_id] = request  # blocks freed once the load stops
                if self.connector is not None:
                    self.connector.cancel_load(req_id)  # a load that waits for its producer stops
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
                or bool(self._aborted_loading) or bool(self.waiting_for_fsm)
                or bool(self._failed_outputs))  # a failure outside a step: the next step sends it

    @property
    def num_waiting(self) -> int:
        """Queued requests, those whose grammar compiles included (as vLLM counts them): a
        router weighing load sees a burst of structured requests before they run."""
        return len(self.waiting) + len(self.waiting_for_fsm)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[list[int]]] = {}
        preempted: list[Request] = []
        now = time.time()
        if self.waiting_for_fsm:
            self._admit_compiled()

        deferred = self._sjf_deferred(now) if isinstance(self.waiting, ShortestFirstQueue) else set()
        drafts: dict[str, list[int]] = {}
        budget = self._schedule_running(budget, num_scheduled, new_blocks, preempted, drafts,
                                        deferred)
        resumed: set[str] = set()
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_blocks, resumed, now)
            if deferred and budget > 0:
                self._schedule_running(budget, num_scheduled, new_blocks, preempted, drafts,
                                       only=deferred)
        out = self._build_output(num_scheduled, new_blocks, resumed, preempted)
        out.scheduled_spec_decode_tokens = {r: d for r, d in drafts.items() if r in num_scheduled}
        out.structured_output_request_ids = self.constrained_samplers(num_scheduled)
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
                          new_blocks: dict[str, list[list[int]]], preempted: list[Request],
                          drafts: dict[str, list[int]],
                          skip: set[str] | frozenset[str] = frozenset(),
                          only: set[str] | None = None) -> int:
        """Schedules running requests in order (those in `skip` not, or only those in `only`),
        decodes with their drafts (in `drafts`).
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
            k = self._draft_count(request, n, budget)
            n += k
            while True:
                blocks = self.kv.allocate_slots(request, n)
                if blocks is not None:
                    break
                if k:  # the drafts' slots do not fit: a plain decode before any preemption
                    n, k = n - k, 0
                    continue
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
            new_blocks[request.request_id] = [[b.block_id for b in group] for group in blocks]
            if k:
                drafts[request.request_id] = request.spec_token_ids[:k]
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
        victim.spec_token_ids = []
        self.counters.preemptions += 1
        self.waiting.prepend(victim)
        return victim

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[list[int]]], resumed: set[str], now: float) -> int:
        """Starts waiting requests in queue order while budget, sequences and blocks last."""
        while (len(self.waiting) > 0 and budget > 0
               and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs):
            request = self.waiting.peek()
            step = WaitingStep(budget, num_scheduled, new_blocks, resumed, now)
            if request.request_id in self._kv_loaded:  # its blocks and loaded KV are in place
                used = self._start_loaded(request, step)
            else:
                used = self._start_waiting(request, step)
            if used is None:  # the queue's head waits: so does everything behind it
                break
            budget -= used
        return budget

    # Each _start_* takes the queue's head and returns the budget it used (0: it left the queue
    # without computing this step, or failed), or None when it must wait (no blocks, sjf, ...).
    def _start_waiting(self, request: Request, step: WaitingStep) -> int | None:
        """A new (or preempted) request: prefix-cache hits, then the connector's offer, then
        what is left to compute."""
        if request.awaiting_first_token and self.kv.usage >= EARLY_MAX_KV_USAGE:
            return self._park(request)  # room kept for running requests: it loads after its token
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
                return 0
            if num_external is None:  # the store has not answered yet
                return None
            if num_external > 0:
                return self._start_loading(request, hits, num_hit_tokens, num_external, load_async,
                                           step)
        if request.awaiting_first_token:  # nothing to load: nothing to compute before the token
            return self._park(request)
        return self._start_computing(request, hits, num_hit_tokens, step)

    def _start_computing(self, request: Request, hits: list[list[KVCacheBlock]], num_hit_tokens: int,
                         step: WaitingStep) -> int | None:
        """Everything after the prefix-cache hits is computed here."""
        n = self._num_new_tokens(request, step.budget, num_hit_tokens)
        if self._sjf_holds_back(step.num_scheduled, n, request.num_tokens - num_hit_tokens):
            return None
        if self.kv.allocate_slots(request, n, num_hit_tokens, hits) is None:
            return 0 if self._drop_loaded(request) else None
        if request.status == RequestStatus.PREEMPTED:
            step.resumed.add(request.request_id)
            if request.num_new_output_tokens == 0:  # its prompt is computed now (a rolled-back load)
                request.times.num_cached_tokens = num_hit_tokens
        else:
            request.times.first_scheduled_time = step.now
            request.times.num_cached_tokens = num_hit_tokens
        self.kv.record_lookup(request, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        return self._start_running(request, n, step.num_scheduled, step.new_blocks)

    def _start_running(self, request: Request, n: int, num_scheduled: dict[str, int],
                       new_blocks: dict[str, list[list[int]]]) -> int:
        """Moves the waiting queue's head, whose blocks are allocated, to running with `n` new
        tokens this step; returns `n`."""
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        num_scheduled[request.request_id] = n
        new_blocks[request.request_id] = self.kv.get_block_ids(request.request_id)
        return n

    def _build_output(self, num_scheduled: dict[str, int], new_blocks: dict[str, list[list[int]]],
                      resumed: set[str], preempted: list[Request]) -> SchedulerOutput:
        new_reqs, cached_reqs = [], []
        for req_id, _n in num_scheduled.items():
            request = self.requests[req_id]
            if req_id not in self._known_by_runner or req_id in resumed:
                self._known_by_runner.add(req_id)
                self._trimmed.pop(req_id, None)
                new_reqs.append(NewRequestData(
                    req_id, list(request.all_token_ids), request.num_prompt_tokens,
                    request.sampling_params, new_blocks[req_id], request.num_computed_tokens,
                    request.cache_salt))
            else:
                cached_reqs.append(CachedRequestData(
                    req_id, new_blocks[req_id], request.num_computed_tokens,
                    self._trimmed.pop(req_id, None)))
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
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        now = time.time()
        self.update_connector_output(runner_output.kv_connector_output)
        outputs, self._failed_outputs = self._failed_outputs, []
        logprobs = runner_output.logprobs or [None] * len(runner_output.req_ids)
        drafted = scheduler_output.scheduled_spec_decode_tokens
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
            if req_id in drafted:
                self._verified(request, len(drafted[req_id]), len(token_ids))
            token_ids, lp, stopped = self._append_checked(request, list(token_ids), lp)
            self.counters.on_tokens(request, len(token_ids), now)
            out = EngineCoreOutput(req_id, token_ids, lp)
            if first and request.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = list(request.prompt_logprobs)
            grammar_error = self._advance_grammar(request, token_ids)
            if grammar_error is not None:
                self._fail(request, grammar_error)
                outputs.append(self._failed_outputs.pop())
                continue
            if stopped or self._grammar_ended(request):
                self.running.remove(request)
                self._free(request)
                request.times.finished_time = now
                self.counters.on_finished(request)
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
                out.times = request.times
                out.kv_transfer_params = request.kv_transfer_params
            else:
                request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
                if req_id in drafted:
                    self._trim_rejected(request)
            outputs.append(out)
        self.counters.end_step()
        return EngineCoreOutputs(outputs=outputs, timestamp=now)



def _keep_prompt_logprobs(request: Request, start: int, entries: list[LogprobsEntry]) -> None:
    """Appends a step's prompt logprobs (entries[k] for prompt token start + 1 + k), skipping
    positions already kept (a preempted or rolled-back request computes them again)."""
    have = len(request.prompt_logprobs)
    if start <= have:
        request.prompt_logprobs.extend(entries[have - start:])
