"""Typed asyncio client of a worker (`pdserve.worker.v1.Worker` + gRPC health).

    async with WorkerClient("127.0.0.1:50051") as prefill:
        first = await prefill.prefill("r1", prompt_ids, params, transfer_id="t1")
    async with WorkerClient("127.0.0.1:50061") as decode:
        async for chunk in decode.decode("r1", [*prompt_ids, first.first_token_id], rest,
                                         first.kv_transfer_params):
            ...

Errors arrive as `grpc.aio.AioRpcError` with the server's status code and message. Cancelling the
task that awaits `prefill` or iterates `decode` cancels the call, which aborts the engine request.

Workers send a call's initial metadata as soon as their engine has the request: `start_prefill`'s
`accepted()` and `decode(announce=True)` let a caller act on that before the first token arrives
(the router starts its streamed HTTP response there, while the prompt is computed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services.worker.convert import params_to_proto


@dataclass(frozen=True)
class PrefillResult:
    """What Decode needs after a prefill: the first token and the KV transfer parameters."""

    first_token_id: int
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int
    logprobs: pb.PositionLogprobs | None = None  # the first token's, when asked for


_PREFILL_PATH = "/pdserve.worker.v1.Worker/Prefill"


class PrefillCall:
    """A Prefill call in flight. Awaiting `result()` gives its PrefillResult (or raises the call's
    error); `cancel()` ends it and aborts the request on the worker."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def accepted(self) -> bool:
        """Waits until the worker has accepted the request (True) or the call ended first (False)."""
        return await _accepted(self._call)

    async def result(self) -> PrefillResult:
        reply = await self._call.read()
        if reply is grpc.aio.EOF:  # a server that ends the call without a reply and with OK status
            raise RuntimeError("the worker ended Prefill without a reply")
        kv = json.loads(reply.kv_transfer_params_json) if reply.kv_transfer_params_json else None
        logprobs = reply.first_logprobs if reply.HasField("first_logprobs") else None
        return PrefillResult(reply.first_token_id, reply.finish_reason, kv, reply.num_cached_tokens,
                             logprobs)

    def cancel(self) -> None:
        """No-op once the call ended."""
        self._call.cancel()


async def _accepted(call: Any) -> bool:
    """True once the call's initial metadata came while the call still runs (workers send it when
    their engine has the request; a call that fails, or ends, sends its metadata with its status)."""
    await call.initial_metadata()
    return not call.done()


class WorkerClient:
    """One channel to one worker. `params.max_tokens` must be set (n and stop strings are not sent)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target)
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
                      transfer_id: str = "", timeout_s: float | None = None) -> PrefillCall:
        """`prefill` as a call in flight: `accepted()`, then `result()`; `cancel()` ends it early."""
        return PrefillCall(self._prefill(pb.PrefillRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            transfer_id=transfer_id), timeout=timeout_s))

    async def decode(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     kv_transfer_params: dict[str, Any] | None = None,
                     timeout_s: float | None = None, announce: bool = False) -> AsyncIterator[pb.DecodeChunk]:
        """Streams the new tokens; the last chunk has finish_reason and usage set. With `announce`,
        an empty chunk (no tokens, no finish_reason) comes first once the worker has accepted the
        request; none comes when the call ends (or fails) before that."""
        call = self.stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            kv_transfer_params_json=json.dumps(kv_transfer_params) if kv_transfer_params else ""),
            timeout=timeout_s)
        try:
            if announce and await _accepted(call):
                yield pb.DecodeChunk()
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()  # no-op once the stream ended; aborts the request when left early

    async def abort(self, request_id: str) -> bool:
        """Aborts a running request; False when the worker does not know it."""
        reply: pb.AbortResponse = await self.stub.Abort(pb.AbortRequest(request_id=request_id))
        return reply.found

    async def load(self) -> pb.LoadReport:
        return await self.stub.Load(pb.LoadRequest())

    async def health(self, service: str = "") -> bool:
        """True when the worker reports SERVING (for `service`, "" = the whole server)."""
        reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
