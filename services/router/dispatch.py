"""Worker pools and the prefill -> decode dispatch of one sample.

    dispatcher = Dispatcher(DispatchOptions(prefill=("127.0.0.1:50051",), decode=("127.0.0.1:50061",)))
    async for step in dispatcher.generate("r1", prompt_ids, params):
        ...  # step.token_ids, step.finish_reason, ...

With prefill workers the prompt runs there first (its KV goes to the KV store) and the decode worker
continues from `prompt + first token`. Without them (colocated mode) the decode worker runs it all.
A failed prefill is retried on another prefill worker, then the decode worker computes the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import cast

import grpc

from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from services.worker.client import PrefillResult, WorkerClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchOptions:
    prefill: tuple[str, ...] = ()  # empty = colocated mode
    decode: tuple[str, ...] = ()
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    load_timeout_s: float = 1.0
    prefill_attempts: int = 2  # prefill workers tried before the decode worker computes the prompt

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("decode: at least one decode (or colocated) worker is needed")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts: must be at least 1, got {self.prefill_attempts}")


@dataclass
class Step:
    """New tokens of one sample; the last step has finish_reason set (and usage from the worker)."""

    token_ids: list[int]
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0


def load_score(load: pb.LoadReport) -> int:
    return int(load.num_waiting) * 4 + int(load.num_running)


class WorkerPool:
    """Clients of the workers of one role; `pick` asks each for its load and takes the least loaded."""

    def __init__(self, targets: Sequence[str], load_timeout_s: float) -> None:
        self.clients = [WorkerClient(t) for t in targets]
        self.load_timeout_s = load_timeout_s
        self._inflight = dict.fromkeys(targets, 0)  # router-side count, breaks ties between refreshes

    async def pick(self, exclude: frozenset[str] = frozenset()) -> WorkerClient | None:
        candidates = [c for c in self.clients if c.target not in exclude]
        if not candidates:
            return None
        scores = await asyncio.gather(*(self._score(c) for c in candidates))
        return min(zip(scores, range(len(candidates)), candidates, strict=True))[2]

    async def _score(self, client: WorkerClient) -> float:
        try:
            load = await asyncio.wait_for(client.load(), self.load_timeout_s)
        except (grpc.RpcError, TimeoutError):
            return float("inf")
        return load_score(load) + self._inflight[client.target] / 1000

    def acquire(self, client: WorkerClient) -> None:
        self._inflight[client.target] += 1

    def release(self, client: WorkerClient) -> None:
        self._inflight[client.target] -= 1

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


class Dispatcher:
    """Runs one sample through a prefill worker and a decode worker (or one colocated worker)."""

    def __init__(self, options: DispatchOptions) -> None:
        self.options = options
        self.prefill = WorkerPool(options.prefill, options.load_timeout_s) if options.prefill else None
        self.decode = WorkerPool(options.decode, options.load_timeout_s)

    async def close(self) -> None:
        await self.decode.close()
        if self.prefill is not None:
            await self.prefill.close()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncGenerator[Step, None]:
        """The sample's tokens as they come. Closing the iterator early cancels the decode call."""
        assert params.max_tokens is not None
        first = await self._prefill(request_id, prompt_ids, params)
        if first is None:
            async for step in self._decode(request_id, prompt_ids, params, None):
                yield step
            return
        done = params.max_tokens == 1 or first.finish_reason == "stop"
        yield Step([first.first_token_id], finish_reason=(first.finish_reason or "length") if done else "",
                   cached_tokens=first.num_cached_tokens)
        if done:
            return
        rest = replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(0, params.min_tokens - 1))
        async for step in self._decode(request_id, [*prompt_ids, first.first_token_id], rest,
                                       first.kv_transfer_params):
            step.cached_tokens = first.num_cached_tokens  # not the tokens loaded from the KV store
            yield step

    async def _prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> PrefillResult | None:
        """The prefill's result, or None when the decode worker should compute the prompt."""
        if self.prefill is None or params.logprobs is not None:  # Prefill returns no logprobs
            return None
        tried: set[str] = set()
        for _ in range(self.options.prefill_attempts):
            worker = await self.prefill.pick(frozenset(tried))
            if worker is None:
                break
            tried.add(worker.target)
            self.prefill.acquire(worker)
            try:
                return await worker.prefill(request_id, prompt_ids, params, transfer_id=uuid.uuid4().hex,
                                            timeout_s=self.options.prefill_timeout_s)
            except grpc.RpcError as e:
                if _code(e) == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                logger.warning("prefill of %s failed on %s: %s", request_id, worker.target, e)
            finally:
                self.prefill.release(worker)
        return None

    async def _decode(self, request_id: str, ids: list[int], params: SamplingParams,
                      kv_transfer_params: dict[str, object] | None) -> AsyncGenerator[Step, None]:
        worker = await self.decode.pick()
        assert worker is not None
        self.decode.acquire(worker)
        try:
            chunks = cast(AsyncGenerator[pb.DecodeChunk, None], worker.decode(
                request_id, ids, params, kv_transfer_params, timeout_s=self.options.decode_timeout_s))
            async with aclosing(chunks):  # leaving early cancels the call, which aborts the request
                async for chunk in chunks:
                    yield Step(list(chunk.token_ids), list(chunk.logprobs), chunk.finish_reason,
                               chunk.usage.cached_tokens)
        finally:
            self.decode.release(worker)


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(error, "code", None)
    return code() if callable(code) else None
