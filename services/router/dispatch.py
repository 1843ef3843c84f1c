"""The prefill -> decode dispatch of one sample over the worker pools.

    dispatcher = Dispatcher(DispatchOptions(prefill=("127.0.0.1:50051",), decode=("127.0.0.1:50061",)))
    dispatcher.start()  # in the event loop: background load / health refresh
    async for step in dispatcher.generate("r1", prompt_ids, params):
        ...  # step.token_ids, step.finish_reason, ...

With prefill workers the prompt runs there first (its KV goes to the KV store) and the decode worker
continues from `prompt + first token`. Without them (colocated mode) the decode worker runs it all.
Conditional disaggregation: when the part of the prompt the chosen decode worker has likely not
cached is at most `local_prefill_tokens`, the decode worker computes it (no transfer). A failed
prefill is retried on another prefill worker, then the decode worker computes the prompt; a worker
whose call fails as unreachable is marked unhealthy (see pool.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import cast

import grpc

from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from services.router.pool import Pick, Policy, PoolOptions, WorkerPool, is_down
from services.router.prefix_index import block_hashes
from services.worker.client import PrefillResult

logger = logging.getLogger(__name__)

class NoWorkerError(Exception):
    """No healthy worker in a pool the request needs."""


@dataclass(frozen=True)
class DispatchOptions:
    prefill: tuple[str, ...] = ()  # empty = colocated mode
    decode: tuple[str, ...] = ()
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    load_timeout_s: float = 1.0
    refresh_s: float = 0.1  # how often worker load and health are refreshed
    prefill_attempts: int = 2  # prefill workers tried before the decode worker computes the prompt
    prefill_policy: Policy = "prefix_aware"
    decode_policy: Policy = "prefix_aware"
    local_prefill_tokens: int = 0  # uncached prompt tokens the decode worker computes itself; 0 = off
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("decode: at least one decode (or colocated) worker is needed")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts: must be at least 1, got {self.prefill_attempts}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: must be >= 0, got {self.local_prefill_tokens}")
        for name in ("prefill_timeout_s", "decode_timeout_s", "load_timeout_s", "refresh_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    def pool_options(self, policy: Policy) -> PoolOptions:
        return PoolOptions(policy=policy, refresh_s=self.refresh_s, load_timeout_s=self.load_timeout_s,
                           block_size=self.block_size)


@dataclass
class Step:
    """New tokens of one sample; the last step has finish_reason set (and usage from the worker).
    A step with neither tokens nor finish_reason, first if at all, says a worker has accepted the
    sample: its prompt is being computed (a streamed response can start there)."""

    token_ids: list[int]
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0

    @property
    def accepted(self) -> bool:
        return not self.token_ids and not self.finish_reason


class Dispatcher:
    """Runs one sample through a prefill worker and a decode worker (or one colocated worker).
    `on_decision(name)` is told how each sample was dispatched (for metrics)."""

    def __init__(self, options: DispatchOptions, on_decision: Callable[[str], None] | None = None,
                 on_prefill_failure: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.prefill = (WorkerPool("prefill", options.prefill, options.pool_options(options.prefill_policy))
                        if options.prefill else None)
        role = "decode" if options.prefill else "colocated"
        self.decode = WorkerPool(role, options.decode, options.pool_options(options.decode_policy))
        self._on_decision = on_decision or _ignore
        self._on_prefill_failure = on_prefill_failure or _ignore

    @property
    def pools(self) -> list[WorkerPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def start(self) -> None:
        for pool in self.pools:
            pool.start()

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncGenerator[Step, None]:
        """The sample's tokens as they come. Closing the iterator early cancels the decode call."""
        assert params.max_tokens is not None
        hashes = block_hashes(prompt_ids, self.options.block_size)
        local = self._local_prefill(prompt_ids, hashes)
        first: PrefillResult | None = None
        announced = False
        if local is None:
            async with aclosing(self._prefill(request_id, prompt_ids, params, hashes)) as items:
                async for item in items:
                    if isinstance(item, PrefillResult):
                        first = item
                    else:
                        announced = True
                        yield item
        if first is None:
            async for step in self._decode(request_id, prompt_ids, params, None, hashes, local,
                                           announce=not announced):
                yield step
            return
        done = params.max_tokens == 1 or first.finish_reason == "stop"
        yield Step([first.first_token_id], [first.logprobs] if first.logprobs is not None else [],
                   finish_reason=(first.finish_reason or "length") if done else "",
                   cached_tokens=first.num_cached_tokens)
        if done:
            return
        rest = replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(0, params.min_tokens - 1))
        async for step in self._decode(request_id, [*prompt_ids, first.first_token_id], rest,
                                       first.kv_transfer_params, hashes):
            step.cached_tokens = first.num_cached_tokens  # not the tokens loaded from the KV store
            yield step

    def _decode_pick(self, hashes: Sequence[int]) -> Pick:
        pick = self.decode.pick(hashes)
        if pick is None:
            raise NoWorkerError(f"no healthy {self.decode.role} worker")
        return pick

    def _local_prefill(self, prompt_ids: list[int], hashes: Sequence[int]) -> Pick | None:
        """Conditional disaggregation: the decode worker to compute the prompt itself when the
        part it has likely not cached is at most local_prefill_tokens, else None."""
        if self.prefill is None or not self.options.local_prefill_tokens:
            return None
        pick = self._decode_pick(hashes)
        if len(prompt_ids) - pick.matched_tokens > self.options.local_prefill_tokens:
            return None
        self._on_decision("local_prefill")
        return pick

    async def _prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       hashes: Sequence[int]) -> AsyncGenerator[Step | PrefillResult, None]:
        """An empty Step once a prefill worker has accepted the request, then the prefill's
        result; no result when the decode worker should compute the prompt."""
        if self.prefill is None:
            self._on_decision("colocated")
            return
        tried: set[str] = set()
        announced = False
        for _ in range(self.options.prefill_attempts):
            pick = self.prefill.pick(hashes, frozenset(tried))
            if pick is None:
                break
            worker = pick.worker
            tried.add(worker.target)
            self.prefill.acquire(worker, hashes)
            call = worker.client.start_prefill(request_id, prompt_ids, params, transfer_id=uuid.uuid4().hex,
                                               timeout_s=self.options.prefill_timeout_s)
            try:
                if not announced and await call.accepted():
                    announced = True
                    yield Step([])
                result = await call.result()
            except grpc.RpcError as e:
                if _code(e) == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                self._on_prefill_failure(worker.target)
                if is_down(e):
                    self.prefill.mark_failed(worker, e)
                logger.warning("prefill of %s failed on %s: %s", request_id, worker.target, e)
                continue
            finally:
                call.cancel()  # no-op once it ended; a consumer that left mid-prefill aborts it
                self.prefill.release(worker)
            self._on_decision("disaggregated")
            yield result
            return
        self._on_decision("fallback")

    async def _decode(self, request_id: str, ids: list[int], params: SamplingParams,
                      kv_transfer_params: dict[str, object] | None, hashes: Sequence[int],
                      pick: Pick | None = None, announce: bool = False) -> AsyncGenerator[Step, None]:
        worker = (pick or self._decode_pick(hashes)).worker
        self.decode.acquire(worker, hashes)
        try:
            chunks = cast(AsyncGenerator[pb.DecodeChunk, None], worker.client.decode(
                request_id, ids, params, kv_transfer_params, timeout_s=self.options.decode_timeout_s,
                announce=announce))
            async with aclosing(chunks):  # leaving early cancels the call, which aborts the request
                async for chunk in chunks:
                    yield Step(list(chunk.token_ids), list(chunk.logprobs), chunk.finish_reason,
                               chunk.usage.cached_tokens)
        except grpc.RpcError as e:
            if is_down(e):
                self.decode.mark_failed(worker, e)
            raise
        finally:
            self.decode.release(worker)


def _ignore(_: str) -> None:
    pass


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(error, "code", None)
    return code() if callable(code) else None
