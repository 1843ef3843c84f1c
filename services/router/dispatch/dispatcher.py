"""The prefill -> decode dispatch of one sample over the worker pools.

    dispatcher = Dispatcher(DispatchOptions(prefill=("127.0.0.1:50051",), decode=("127.0.0.1:50061",)))
    dispatcher.start()  # in the event loop: background load / health refresh, stall watchdog
    async for step in dispatcher.generate("r1", prompt_ids, params):
        ...  # step.token_ids, step.finish_reason, ...

With prefill workers the prompt runs there first (its KV goes to the KV store) and the decode worker
continues from `prompt + first token`. Early hand-off (`early_handoff`, the default): the decode
call goes out together with the prefill (prompt only, await_first_token), so the decode worker
allocates the blocks and loads each layer's KV while the prefill still runs; the prefill's
first token then goes to it (FirstToken) and its first step starts at once. An early call that
fails before its first token (or a FirstToken that finds no request) falls back to the plain
hand-off on the same worker, and counts as no migration. Without prefill workers (colocated
mode) the decode worker runs it all.
Conditional disaggregation: when the part of the prompt the chosen decode worker has likely not
cached is at most `local_prefill_tokens`, the decode worker computes it (no transfer). A failed
prefill is retried on another prefill worker, then the decode worker computes the prompt; a worker
whose call fails as unreachable is marked unhealthy (see pool.py).

Migration (as Dynamo's): when a decode (or colocated) stream breaks, stays silent for
`stall_timeout_s` (no token and no worker heartbeat), or its worker turns unreachable, the sample
continues on another worker from the prompt plus every token already streamed, with the same KV
transfer (the new worker loads the prompt's KV from the store where it still is, and computes
the rest). The caller sees one stream, with no token repeated or missing. At most
`max_migrations` per sample; each is logged with its reason and counted (`on_migration`). When
no other worker serves, the sample waits up to `migration_wait_s` for one; the failed worker
counts again once a load report after the failure says it serves (its engine core restarted,
or the whole worker did).

Every continuation (the decode after a prefill, each migration) tells the worker how many of its
input tokens are the sample's earlier outputs (`num_output_tokens`) and sends the whole
sample's parameters, so the worker samples as if it had produced them: a seeded draw depends on
(seed, output position) only, and penalties, bad_words, min_tokens and max_tokens count them.
A seeded sample's tokens are the same split, colocated, and after a migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import Any

from engine.sampling_params import SamplingParams
from services.router.dispatch import trace_calls
from services.router.dispatch.early import EarlyDecode, start_early
from services.router.dispatch.inflight import Attempt, EndedByRouter, InFlight
from services.router.dispatch.pool import Pick, WorkerPool, WorkerState, is_down
from services.router.dispatch.prefix_index import block_hashes
from services.router.dispatch.sample import DispatchOptions, NoWorkerError, Step, _Sample
from services.worker.client import PrefillResult, WorkerError

logger = logging.getLogger(__name__)


class Dispatcher:
    """Runs one sample through a prefill worker and a decode worker (or one colocated worker).
    `on_decision(name)` is told how each sample was dispatched, `on_migration(reason)` each time
    one moved to another worker ("broken", "stalled" or "unhealthy"), `on_handoff(seconds, mode)` the
    time from a prefill's first token to the decode worker's first (the sample's second),
    `on_prefix(pool, exact, expected, found)` for each call that computes a prompt the prompt
    tokens the router expected its worker to have cached (from its KV events when `exact`, else
    the approximate index) and those the worker found, for metrics."""

    def __init__(self, options: DispatchOptions, on_decision: Callable[[str], None] | None = None,
                 on_prefill_failure: Callable[[str], None] | None = None,
                 on_migration: Callable[[str], None] | None = None,
                 on_handoff: Callable[[float, str], None] | None = None,
                 on_prefix: Callable[[str, bool, int, int], None] | None = None) -> None:
        self.options = options
        self._on_prefix = on_prefix or (lambda pool, exact, expected, found: None)
        self.inflight = InFlight(options.stall_timeout_s)
        self.prefill = (WorkerPool("prefill", options.prefill, options.pool_options(options.prefill_policy),
                                   on_unhealthy=self._worker_unhealthy)
                        if options.prefill else None)
        role = "decode" if options.prefill else "colocated"
        self.decode = WorkerPool(role, options.decode, options.pool_options(options.decode_policy),
                                 on_unhealthy=self._worker_unhealthy)
        self._on_decision = on_decision or _ignore
        self._on_prefill_failure = on_prefill_failure or _ignore
        self._on_migration = on_migration or _ignore
        self._on_handoff = on_handoff or (lambda _seconds, _mode: None)

    @property
    def pools(self) -> list[WorkerPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def max_model_len(self) -> int | None:
        """The smallest max_model_len the healthy workers have reported (of all that reported
        when none is healthy; None before any has): a request that fits it fits whichever worker
        takes it."""
        reported = [(w.healthy, w.load.max_model_len) for pool in self.pools for w in pool.workers
                    if w.load is not None and w.load.max_model_len > 0]
        healthy = [n for ok, n in reported if ok]
        return min(healthy or [n for _, n in reported]) if reported else None

    def start(self) -> None:
        for pool in self.pools:
            pool.start()
        self.inflight.start()

    async def close(self) -> None:
        await self.inflight.close()
        for pool in self.pools:
            await pool.close()

    def _worker_unhealthy(self, w: WorkerState, why: str, down: bool) -> None:
        """Prefills on a worker gone unhealthy are retried elsewhere at once; decode streams
        only when it is unreachable (a slow or briefly frozen one may go on: the stall timeout
        decides for those)."""
        n = self.inflight.end_all_on(w.target, f"worker unhealthy: {why}", streams=down)
        if n:
            logger.warning("%d calls in flight on %s are moved elsewhere", n, w.target)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str = "") -> AsyncGenerator[Step, None]:
        """The sample's tokens as they come. Closing the iterator early cancels the decode call.
        `priority` is the workers' scheduling priority (lower first); `cache_salt` goes to every
        call of the sample (prefill, decode, migrations) and into its prefix-index hashes."""
        assert params.max_tokens is not None
        hashes = block_hashes(prompt_ids, self.options.block_size, cache_salt)
        # a prompt_logprobs request computes its whole prompt wherever it runs: not in a decode batch
        local = self._local_prefill(prompt_ids, hashes) if params.prompt_logprobs is None else None
        first: PrefillResult | None = None
        announced = False
        sample = _Sample(request_id, prompt_ids, params, None, hashes,
                         time.monotonic() + self.options.decode_timeout_s, priority, cache_salt)
        handing: asyncio.Future[bool] | None = None
        opts = self.options
        # the early call lives through the prefill's attempts, then the decode's own time
        early = (start_early(self.decode, request_id, prompt_ids, params, hashes,
                             opts.prefill_timeout_s * opts.prefill_attempts + opts.decode_timeout_s,
                             priority, cache_salt, self.prefill.shared_tp_size())
                 if local is None and self.prefill is not None and opts.early_handoff else None)
        handed = False  # the early call (if any) went on to the decode; else it is dropped below
        try:
            if local is None:
                async with aclosing(self._prefill(request_id, prompt_ids, params, hashes, priority,
                                                  cache_salt)) as items:
                    async for item in items:
                        if isinstance(item, PrefillResult):
                            first = item
                        else:
                            announced = True
                            yield item
            if first is not None:
                done = params.max_tokens == 1 or first.finish_reason == "stop"
                # the decode worker gets the token while the caller gets it
                handing = (asyncio.ensure_future(early.hand_over(
                    first, opts.stall_timeout_s, opts.load_timeout_s))
                    if early is not None and not done else None)
                yield Step([first.first_token_id], [first.logprobs] if first.logprobs is not None else [],
                           finish_reason=(first.finish_reason or "length") if done else "",
                           cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs)
                if done:
                    return
                sample.generated.append(first.first_token_id)
                sample.kv = first.kv_transfer_params
                handed = handing is not None and await handing
            # else no prefill result: the decode worker computes the prompt (plain call)
        finally:
            if not handed:
                if handing is not None:
                    handing.cancel()
                if early is not None:
                    early.drop()
                early = None
        sample.deadline = time.monotonic() + opts.decode_timeout_s  # the decode's own, from now
        handoff_from = time.monotonic() if first is not None else None
        async with aclosing(self._decode(sample, local, announce=first is None and not announced,
                                         early=early)) as steps:
            async for step in steps:
                if handoff_from is not None and step.token_ids:
                    mode = "early" if early is not None and not early.fell_back else "after_prefill"
                    self._on_handoff(time.monotonic() - handoff_from, mode)
                    handoff_from = None
                # Prompt tokens not computed: the prefill's (not the tokens loaded from the
                # store), or the decode call's, never more than the prompt (after a migration
                # the streamed tokens count as that call's prompt).
                step.cached_tokens = (first.num_cached_tokens if first is not None
                                      else min(step.cached_tokens, len(prompt_ids)))
                yield step

    def _decode_pick(self, hashes: Sequence[bytes], prompt_tokens: int) -> Pick:
        pick = self.decode.pick(hashes, prompt_tokens=prompt_tokens)
        if pick is None:
            raise NoWorkerError(f"no healthy {self.decode.role} worker")
        return pick

    def _local_prefill(self, prompt_ids: list[int], hashes: Sequence[bytes]) -> Pick | None:
        """Conditional disaggregation: the decode worker to compute the prompt itself when the
        part it has likely not cached is at most local_prefill_tokens, else None."""
        if self.prefill is None or not self.options.local_prefill_tokens:
            return None
        pick = self._decode_pick(hashes, len(prompt_ids))
        if len(prompt_ids) - pick.matched_tokens > self.options.local_prefill_tokens:
            return None
        self._on_decision("local_prefill")
        return pick

    async def _prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       hashes: Sequence[bytes], priority: int, cache_salt: str = ""
                       ) -> AsyncGenerator[Step | PrefillResult, None]:
        """An empty Step once a prefill worker has accepted the request, then the prefill's
        result; no result when the decode worker should compute the prompt."""
        if self.prefill is None:
            self._on_decision("colocated")
            return
        tried: set[str] = set()
        announced = False
        for _ in range(self.options.prefill_attempts):
            pick = self.prefill.pick(hashes, frozenset(tried), len(prompt_ids))
            if pick is None:
                break
            worker = pick.worker
            tried.add(worker.target)
            lease = self.prefill.acquire(worker, hashes, len(prompt_ids))
            done = False
            span = trace_calls.start("prefill", worker.target, attempt=len(tried),
                                     expected_cached_tokens=lease.matched_tokens,
                                     prefix_index="events" if lease.exact else "approximate")
            error: BaseException | None = None
            found = 0
            try:
                async with aclosing(self._prefill_on(worker, request_id, prompt_ids, params, priority,
                                                     cache_salt, not announced, span)) as items:
                    async for item in items:
                        announced = announced or isinstance(item, Step)
                        done = isinstance(item, PrefillResult)
                        if isinstance(item, PrefillResult):
                            found = item.num_cached_tokens
                            self._on_decision("disaggregated")
                            self._on_prefix("prefill", lease.exact, lease.matched_tokens,
                                            item.num_cached_tokens)
                        yield item
            except WorkerError as e:
                error = e
                if e.kind == "invalid":
                    raise
                self._on_prefill_failure(worker.target)
                if is_down(e):
                    self.prefill.mark_failed(worker, e)
                logger.warning("prefill of %s failed on %s: %s", request_id, worker.target, e.message)
                continue
            finally:
                self.prefill.release(lease, len(prompt_ids) if done else 0)
                trace_calls.end(span, error, cached_tokens=found)
            if done:
                return
        self._on_decision("fallback")

    async def _prefill_on(self, worker: WorkerState, request_id: str, prompt_ids: list[int],
                          params: SamplingParams, priority: int, cache_salt: str, announce: bool,
                          span: Any = None) -> AsyncGenerator[Step | PrefillResult, None]:
        """One prefill attempt: an empty Step once accepted (with `announce`), then the result."""
        with trace_calls.current(span):  # (the call's metadata carries the attempt's span)
            call = worker.client.start_prefill(request_id, prompt_ids, params,
                                               transfer_id=uuid.uuid4().hex,
                                               timeout_s=self.options.prefill_timeout_s,
                                               priority=priority, cache_salt=cache_salt)
        attempt = self.inflight.add(Attempt(worker.target, call.cancel, watch_stall=False))
        try:
            with _ended_by_router(attempt):
                if announce and await call.accepted():
                    yield Step([])
                yield await call.result()
        finally:
            self.inflight.discard(attempt)
            call.cancel()  # no-op once it ended; a consumer that left mid-prefill aborts it

    async def _decode(self, sample: _Sample, pick: Pick | None = None, announce: bool = False,
                      early: EarlyDecode | None = None) -> AsyncGenerator[Step, None]:
        """The sample's decode, moved to another worker as often as needed (and allowed). An
        early call that fails before its first token is followed by the plain hand-off on the
        same worker (unless that worker is down)."""
        worker = early.worker if early else (
            pick or self._decode_pick(sample.hashes, len(sample.prompt_ids))).worker
        while True:
            streamed = len(sample.generated)
            try:
                async with aclosing(self._decode_on(worker, sample, announce, early)) as steps:
                    async for step in steps:
                        if (early is not None and step.finish_reason == "abort" and not step.token_ids
                                and len(sample.generated) == streamed):
                            # ended before its first token (its load failed under the "fail"
                            # policy, or the engine refused it): the plain hand-off instead
                            raise WorkerError(worker.target, "failed",
                                              "the early decode ended before its first token")
                        yield step
                return
            except WorkerError as e:
                if early is not None and len(sample.generated) == streamed and not is_down(e) \
                        and e.kind != "timeout":
                    logger.warning("early decode of %s on %s failed before its first token (%s): "
                                   "handing off after the prefill", sample.request_id, worker.target,
                                   e.message)
                    early.fell_back = True
                    early = None
                    continue
                early = None
                if e.kind in ("invalid", "timeout") or sample.migrations >= self.options.max_migrations:
                    raise
                if is_down(e):
                    self.decode.mark_failed(worker, e)
                reason = e.why if isinstance(e, EndedByRouter) else "broken"
                failed = worker.target
                sample.failed[failed] = time.monotonic()
                worker = await self._migration_target(sample)
                sample.migrations += 1
                announce = False
                self._on_migration(reason)
                logger.warning("migrating %s from %s to %s after %d tokens (%s): %s", sample.request_id,
                               failed, worker.target, len(sample.generated), reason, e.message)

    async def _decode_on(self, worker: WorkerState, sample: _Sample, announce: bool,
                         early: EarlyDecode | None = None) -> AsyncGenerator[Step, None]:
        """One attempt: the rest of the sample on `worker` (through the early call given, which
        has its first token). Raises WorkerError when the stream breaks, stalls, or the router
        ended it; a stream that ends without finishing is broken."""
        remaining = sample.deadline - time.monotonic()
        if remaining <= 0:
            if early is not None:
                early.drop()
            raise WorkerError(worker.target, "timeout", "the sample's decode deadline passed")
        rid, ids = sample.next_call()
        computes_prompt = early is None and sample.kv is None and not sample.generated
        if early is not None:
            lease = early.take_lease()
            span = early.span
        else:
            lease = self.decode.acquire(worker, sample.hashes, len(sample.prompt_ids))
            span = trace_calls.start("decode", worker.target, attempt=len(sample.failed) + 1,
                                     migration=bool(sample.failed), computes_prompt=computes_prompt,
                                     expected_cached_tokens=lease.matched_tokens,
                                     prefix_index="events" if lease.exact else "approximate")
        error: BaseException | None = None
        try:
            # prompt logprobs come from the call that computes the first token, once
            params = replace(sample.params, prompt_logprobs=None) if sample.generated else sample.params
            with trace_calls.current(span):
                call = early.call if early is not None else worker.client.start_decode(
                    rid, ids, params, sample.kv, timeout_s=remaining, announce=announce,
                    num_output_tokens=len(sample.generated), priority=sample.priority,
                    cache_salt=sample.cache_salt)
            attempt = self.inflight.add(Attempt(worker.target, call.cancel, watch_stall=True))
            try:
                async with aclosing(call.chunks()) as chunks:
                    with _ended_by_router(attempt):
                        async for chunk in chunks:
                            attempt.touch()
                            if chunk.empty:
                                if announce:  # the acceptance; later empty chunks are heartbeats
                                    announce = False
                                    attempt.pause()  # the caller's time is not the worker's
                                    yield Step([])
                                    attempt.touch()
                                continue
                            announce = False
                            if computes_prompt and chunk.finish_reason:  # (usage comes last)
                                self._on_prefix("decode", lease.exact, lease.matched_tokens,
                                                chunk.cached_tokens)
                            sample.generated.extend(chunk.token_ids)
                            attempt.pause()
                            yield Step(chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                                       chunk.cached_tokens, chunk.prompt_logprobs)
                            attempt.touch()
                            if chunk.finish_reason:
                                return
                raise WorkerError(worker.target, "unavailable", "the stream ended without a finish")
            finally:
                self.inflight.discard(attempt)
        except BaseException as e:
            error = e
            raise
        finally:
            self.decode.release(lease, len(sample.prompt_ids) + len(sample.generated))
            trace_calls.end(span, error if isinstance(error, Exception) else None,
                            generated_tokens=len(sample.generated))

    async def _migration_target(self, sample: _Sample) -> WorkerState:
        """A serving worker on which the sample has not failed (or one it failed on, once a load
        report after that failure says it serves), waited for up to migration_wait_s."""
        deadline = min(sample.deadline, time.monotonic() + self.options.migration_wait_s)
        while True:
            pick = self.decode.pick(sample.hashes, frozenset(sample.failed), len(sample.prompt_ids))
            if pick is None:
                back = [w for t, at in sample.failed.items() if (w := self.decode.find(t)) is not None
                        and w.healthy and not w.draining and w.reported_at > at]
                pick = Pick(back[0], 0) if back else None
            if pick is not None:
                return pick.worker
            if time.monotonic() > deadline:
                raise NoWorkerError(f"no {self.decode.role} worker to continue {sample.request_id} on "
                                    f"(it failed on {', '.join(sample.failed)})")
            await asyncio.sleep(0.1)


@contextmanager
def _ended_by_router(attempt: Attempt) -> Iterator[None]:
    """Inside: a call the router ended (stalled, worker unhealthy) raises its EndedByRouter,
    whatever the cancelled call raised; the consumer leaving still cancels as it should."""
    try:
        yield
    except (asyncio.CancelledError, WorkerError) as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        if attempt.ended is not None:
            raise attempt.ended from None
        if isinstance(e, asyncio.CancelledError):  # the channel went away under the call
            raise WorkerError(attempt.target, "unavailable", "the call was cancelled") from None
        raise


def _ignore(_: object) -> None:
    pass

