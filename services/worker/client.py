"""Typed asyncio client of a worker (`pdserve.worker.v1.Worker` + gRPC health).

    async with WorkerClient("127.0.0.1:50051") as prefill:
        first = await prefill.prefill("r1", prompt_ids, params, transfer_id="t1")
    async with WorkerClient("127.0.0.1:50061") as decode:
        async for chunk in decode.decode("r1", [*prompt_ids, first.first_token_id], rest,
                                         first.kv_transfer_params):
            ...  # chunk.token_ids, chunk.logprobs, chunk.finish_reason; empty chunks are heartbeats

Nothing of gRPC leaves this module: a failed call raises WorkerError, whose `kind` says what a
caller can do (`invalid`: the request is wrong; `unavailable`: this worker cannot serve it now,
another may; `timeout`; `failed`: anything else), and logprobs are plain `Logprob` lists.
Cancelling the task that awaits `prefill` or iterates `decode` cancels the call, which aborts
the engine request.

Workers send a call's initial metadata as soon as their engine has the request: `start_prefill`'s
`accepted()` and `decode(announce=True)` let a caller act on that before the first token arrives
(the router starts its streamed response there, while the prompt is computed).

Every call but health's carries the worker token, and the channel is TLS when the access says so
(`WorkerAccess`, by default from the PDSERVE_WORKER_* environment; services/worker/auth.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services import tracing
from services.worker.auth import WorkerAccess
from services.worker.convert import (
    MESSAGE_SIZE_OPTIONS,
    kv_params_to_dict,
    kv_params_to_proto,
    params_to_proto,
)

ErrorKind = Literal["invalid", "unavailable", "timeout", "failed"]
_KINDS: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.OUT_OF_RANGE: "invalid",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.UNKNOWN: "unavailable",
    grpc.StatusCode.INTERNAL: "unavailable", grpc.StatusCode.CANCELLED: "unavailable",
    grpc.StatusCode.ABORTED: "unavailable", grpc.StatusCode.RESOURCE_EXHAUSTED: "unavailable",
}


class WorkerError(Exception):
    """A worker call failed. `kind`: see the module docstring; `down`: the worker looks
    unreachable or broken (not merely busy), so a router stops sending it requests."""

    def __init__(self, target: str, kind: ErrorKind, message: str, down: bool = False) -> None:
        super().__init__(f"{target}: {message}")
        self.target, self.kind, self.message, self.down = target, kind, message, down

    @classmethod
    def from_rpc(cls, target: str, error: grpc.RpcError) -> WorkerError:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        down = code == grpc.StatusCode.UNAVAILABLE  # UNKNOWN / INTERNAL: that call's trouble
        return cls(target, _KINDS.get(code, "failed"), f"{code.name}: {details}", down)


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


# One position: the sampled token first, then the top candidates (not repeating it).
PositionLogprobs = list[Logprob]


# A token a grammar (or allowed_token_ids) forbids has logprob -inf, which JSON cannot carry (a
# reply would be a 500): clamped as vLLM's server does.
MIN_LOGPROB = -9999.0


def _logprobs(position: pb.PositionLogprobs) -> PositionLogprobs:
    return [Logprob(c.token_id, max(c.logprob, MIN_LOGPROB), c.rank) for c in position.candidates]


@dataclass(frozen=True)
class PrefillResult:
    """What Decode needs after a prefill: the first token and the KV transfer parameters."""

    first_token_id: int
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int
    logprobs: PositionLogprobs | None = None  # the first token's, when asked for
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # positions 1.., if asked


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # the Decode call's token ids
    completion_tokens: int  # tokens that call generated
    cached_tokens: int  # prompt tokens not computed there (prefix cache or KV store)


@dataclass
class DecodeChunk:
    """New tokens of a Decode stream; the last chunk has finish_reason and usage set. A chunk
    with neither tokens nor finish_reason is a heartbeat (or, first, the acceptance)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # first chunk, if asked

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage is not None else 0

    @property
    def empty(self) -> bool:
        return not self.token_ids and not self.finish_reason


_PREFILL_PATH = "/pdserve.worker.v1.Worker/Prefill"


class PrefillCall:
    """A Prefill call in flight. Awaiting `result()` gives its PrefillResult (or raises
    WorkerError); `cancel()` ends it and aborts the request on the worker."""

    def __init__(self, target: str, call: Any) -> None:
        self._target = target
        self._call = call

    async def accepted(self) -> bool:
        """Waits until the worker has accepted the request (True) or the call ended first (False)."""
        try:
            return await _accepted(self._call)
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self._target, e) from None

    async def result(self) -> PrefillResult:
        try:
            reply = await self._call.read()
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self._target, e) from None
        if reply is grpc.aio.EOF:  # a server that ends the call without a reply and with OK status
            raise WorkerError(self._target, "failed", "the worker ended Prefill without a reply")
        kv = kv_params_to_dict(reply.kv_transfer) if reply.HasField("kv_transfer") else None
        logprobs = _logprobs(reply.first_logprobs) if reply.HasField("first_logprobs") else None
        return PrefillResult(reply.first_token_id, reply.finish_reason, kv, reply.num_cached_tokens,
                             logprobs, [_logprobs(p) for p in reply.prompt_logprobs])

    def cancel(self) -> None:
        """No-op once the call ended."""
        self._call.cancel()


def _chunk(c: pb.DecodeChunk) -> DecodeChunk:
    u = c.usage
    usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if c.HasField("usage") else None
    return DecodeChunk(list(c.token_ids), [_logprobs(p) for p in c.logprobs], c.finish_reason, usage,
                       [_logprobs(p) for p in c.prompt_logprobs])


class DecodeCall:
    """A Decode call in flight: `chunks()` streams it (raising WorkerError when it fails);
    `cancel()` ends it and aborts the request on the worker."""

    def __init__(self, target: str, call: Any, announce: bool) -> None:
        self._target = target
        self._call = call
        self._announce = announce

    async def chunks(self) -> AsyncGenerator[DecodeChunk, None]:
        call = self._call
        try:
            if self._announce and await _accepted(call):
                yield DecodeChunk([])
            async for c in call:
                yield _chunk(c)
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self._target, e) from None
        finally:
            call.cancel()  # no-op once the stream ended; aborts the request when left early

    async def accepted(self) -> bool:
        """Waits until the worker's engine has the request: True, or False when the call ended
        first (it failed: iterating `chunks()` raises why)."""
        try:
            return await _accepted(self._call)
        except grpc.RpcError:
            return False

    def cancel(self) -> None:
        self._call.cancel()


async def _accepted(call: Any) -> bool:
    """True once the call's initial metadata came while the call still runs (workers send it when
    their engine has the request; a call that fails, or ends, sends its metadata with its status)."""
    await call.initial_metadata()
    return not call.done()


class WorkerClient:
    """One channel to one worker. `params.max_tokens` must be set (n and stop strings are not sent).
    `access`: the token and TLS files (None = WorkerAccess.from_env()); `server_name`: the name
    the worker's TLS certificate carries, when `target` is an address that name resolved to."""

    def __init__(self, target: str, access: WorkerAccess | None = None, server_name: str | None = None
                 ) -> None:
        self.target = target
        access = access if access is not None else WorkerAccess.from_env()
        self._metadata = access.metadata
        self.channel = access.aio_channel(target, MESSAGE_SIZE_OPTIONS, server_name)
        self.stub = pb_grpc.WorkerStub(self.channel)
        # Prefill called as a server stream of one reply: the same bytes on the wire, but unlike a
        # unary call (one batch of operations in grpc.aio) its initial metadata can be read alone.
        self._prefill = self.channel.unary_stream(_PREFILL_PATH,
                                                  request_serializer=pb.PrefillRequest.SerializeToString,
                                                  response_deserializer=pb.PrefillResponse.FromString)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def prefill(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                      transfer_id: str = "", timeout_s: float | None = None) -> PrefillResult:
        """Runs the prompt for one token on a prefill worker; its KV goes to the KV store."""
        return await self.start_prefill(request_id, token_ids, params, transfer_id, timeout_s).result()

    def start_prefill(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                      transfer_id: str = "", timeout_s: float | None = None,
                      priority: int = 0, cache_salt: str = "") -> PrefillCall:
        """`prefill` as a call in flight: `accepted()`, then `result()`; `cancel()` ends it early.
        `cache_salt`: the request's KV is shared only with requests of the same salt."""
        return PrefillCall(self.target, self._prefill(pb.PrefillRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            transfer_id=transfer_id, priority=priority, cache_salt=cache_salt), timeout=timeout_s,
            metadata=(*self._metadata, *tracing.outgoing_metadata())))

    def start_decode(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     kv_transfer_params: dict[str, Any] | None = None,
                     timeout_s: float | None = None, announce: bool = False,
                     num_output_tokens: int = 0, priority: int = 0, cache_salt: str = "",
                     await_first_token: bool = False) -> DecodeCall:
        """`decode` as a call in flight: iterate `chunks()`; `cancel()` ends it from elsewhere.
        `num_output_tokens`: how many of `token_ids` (at the end) are the sample's earlier
        outputs (DecodeRequest.num_output_tokens; `params` are the whole sample's then).
        `await_first_token`: an early hand-off (token_ids the prompt only); `first_token`
        gives it the prefill's first token."""
        call = self.stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            kv_transfer=kv_params_to_proto(kv_transfer_params), num_output_tokens=num_output_tokens,
            priority=priority, cache_salt=cache_salt, await_first_token=await_first_token),
            timeout=timeout_s, metadata=(*self._metadata, *tracing.outgoing_metadata()))
        return DecodeCall(self.target, call, announce)

    async def first_token(self, request_id: str, token_id: int,
                          kv_transfer_params: dict[str, Any] | None, timeout_s: float | None = None
                          ) -> bool:
        """Gives an early Decode its prefill's first token; False when no Decode of that id
        awaits one on this worker."""
        try:
            reply: pb.FirstTokenResponse = await self.stub.FirstToken(pb.FirstTokenRequest(
                request_id=request_id, first_token_id=token_id,
                kv_transfer=kv_params_to_proto(kv_transfer_params)),
                timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self.target, e) from None
        return reply.found

    async def decode(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     kv_transfer_params: dict[str, Any] | None = None,
                     timeout_s: float | None = None, announce: bool = False) -> AsyncIterator[DecodeChunk]:
        """Streams the new tokens; the last chunk has finish_reason set. With `announce`, an empty
        chunk comes first once the worker has accepted the request (none when the call ends or
        fails before that); later empty chunks are the worker's heartbeats."""
        call = self.start_decode(request_id, token_ids, params, kv_transfer_params, timeout_s, announce)
        async for chunk in call.chunks():
            yield chunk

    async def abort(self, request_id: str) -> bool:
        """Aborts a running request; False when the worker does not know it."""
        try:
            reply: pb.AbortResponse = await self.stub.Abort(pb.AbortRequest(request_id=request_id),
                                                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self.target, e) from None
        return reply.found

    async def load(self, timeout_s: float | None = None) -> pb.LoadReport:
        """The worker's load report (serving or not, and why; queues; KV use; instance id)."""
        try:
            report: pb.LoadReport = await self.stub.Load(pb.LoadRequest(), timeout=timeout_s,
                                                              metadata=self._metadata)
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self.target, e) from None
        return report

    async def health(self, service: str = "") -> bool:
        """True when the worker reports SERVING (for `service`, "" = the whole server)."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        except grpc.RpcError as e:
            raise WorkerError.from_rpc(self.target, e) from None
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
