"""The early hand-off's decode call (dispatcher.py's module docstring): sent together with the
prefill, prompt only, await_first_token; the prefill's first token goes to it with FirstToken."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.sampling_params import SamplingParams
from services.router.dispatch import trace_calls
from services.router.dispatch.pool import WorkerPool, WorkerState
from services.worker.client import DecodeCall, PrefillResult, WorkerError

logger = logging.getLogger(__name__)


@dataclass
class EarlyDecode:
    """A decode call sent with the prefill, its worker and its lease in the decode pool."""

    pool: WorkerPool
    worker: WorkerState
    request_id: str
    call: DecodeCall
    lease: Any
    released: bool = False
    fell_back: bool = False  # it failed before its first token: the plain hand-off ran instead
    span: Any = None  # its trace span (dispatch/trace_calls.py), ended by the decode attempt

    def end_span(self, why: str) -> None:
        """The call will not be the decode attempt (dropped, or the plain hand-off runs)."""
        if self.span is not None:
            self.span.set_attribute("pdserve.dropped", why)
            trace_calls.end(self.span)
            self.span = None

    def take_lease(self) -> Any:
        """The lease, now the decode attempt's to release."""
        self.released = True
        return self.lease

    def drop(self) -> None:
        """Cancels the call (the worker aborts the request) and releases the lease."""
        self.call.cancel()
        if not self.released:
            self.released = True
            self.pool.release(self.lease, 0)
            self.end_span("dropped")

    async def hand_over(self, first: PrefillResult, accept_timeout_s: float, timeout_s: float) -> bool:
        """Gives the call the prefill's first token; False when it cannot take it (the call
        failed or was not accepted within accept_timeout_s, or the worker knows no such
        request): the plain hand-off runs then."""
        try:
            if not await asyncio.wait_for(self.call.accepted(), accept_timeout_s):
                return False
            found = await self.worker.client.first_token(
                self.request_id, first.first_token_id, first.kv_transfer_params, timeout_s=timeout_s)
        except (WorkerError, TimeoutError) as e:
            why = e.message if isinstance(e, WorkerError) else "not accepted in time"
            logger.warning("early hand-off of %s to %s failed (%s); handing off after the prefill",
                           self.request_id, self.worker.target, why)
            return False
        if not found:
            logger.warning("early hand-off of %s: %s had no such request; handing off after the "
                           "prefill", self.request_id, self.worker.target)
        return found


def start_early(pool: WorkerPool, request_id: str, prompt_ids: list[int], params: SamplingParams,
                hashes: Sequence[bytes], timeout_s: float, priority: int, cache_salt: str,
                prefill_tp: int | None) -> EarlyDecode | None:
    """The decode call of an early hand-off, sent now; None where the plain hand-off runs (one
    token, structured outputs, no serving decode worker now: the plain path says so later; or
    prefill workers of different tensor-parallel sizes, `prefill_tp` None: the decode worker
    could not know under which TP size's keys the prefill will save, before it names them)."""
    if params.structured_outputs is not None or (params.max_tokens or 0) <= 1 or prefill_tp is None:
        return None
    pick = pool.pick(hashes, prompt_tokens=len(prompt_ids))
    if pick is None:
        return None
    worker = pick.worker
    rid = f"{request_id}-e"  # not the plain hand-off's id: a fallback on this worker never collides
    lease = pool.acquire(worker, hashes, len(prompt_ids))
    kv = {"do_remote_prefill": True, "keys": [], "num_tokens": len(prompt_ids), "transfer_id": rid,
          "tp_size": prefill_tp}
    span = trace_calls.start("decode", worker.target, attempt=1, early_handoff=True,
                             expected_cached_tokens=lease.matched_tokens,
                             prefix_index="events" if lease.exact else "approximate")
    with trace_calls.current(span):
        call = worker.client.start_decode(
            rid, prompt_ids, replace(params, prompt_logprobs=None), kv,
            timeout_s=timeout_s, priority=priority, cache_salt=cache_salt,
            await_first_token=True)
    return EarlyDecode(pool, worker, rid, call, lease, span=span)
