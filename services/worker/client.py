"""Typed asyncio client of a worker (`pdserve.worker.v1.Worker` + gRPC health).

    async with WorkerClient("127.0.0.1:50051") as prefill:
        first = await prefill.prefill("r1", prompt_ids, params, transfer_id="t1")
    async with WorkerClient("127.0.0.1:50061") as decode:
        async for chunk in decode.decode("r1", [*prompt_ids, first.first_token_id], rest,
                                         first.kv_transfer_params):
            ...

Errors arrive as `grpc.aio.AioRpcError` with the server's status code and message. Cancelling the
task that awaits `prefill` or iterates `decode` cancels the call, which aborts the engine request.
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


class WorkerClient:
    """One channel to one worker. `params.max_tokens` must be set (n and stop strings are not sent)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.WorkerStub(self.channel)
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
        reply: pb.PrefillResponse = await self.stub.Prefill(pb.PrefillRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            transfer_id=transfer_id), timeout=timeout_s)
        kv = json.loads(reply.kv_transfer_params_json) if reply.kv_transfer_params_json else None
        logprobs = reply.first_logprobs if reply.HasField("first_logprobs") else None
        return PrefillResult(reply.first_token_id, reply.finish_reason, kv, reply.num_cached_tokens,
                             logprobs)

    async def decode(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     kv_transfer_params: dict[str, Any] | None = None,
                     timeout_s: float | None = None) -> AsyncIterator[pb.DecodeChunk]:
        """Streams the new tokens; the last chunk has finish_reason and usage set."""
        call = self.stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=token_ids, params=params_to_proto(params),
            kv_transfer_params_json=json.dumps(kv_transfer_params) if kv_transfer_params else ""),
            timeout=timeout_s)
        try:
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
