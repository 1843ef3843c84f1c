"""A streamed response starts once a worker has accepted the request, not at its first token: the
client has its 200 and headers while the prompt is still being computed (as vLLM's server
answers), and a failure after that point still ends the stream with an error event and [DONE].

The workers here are real gRPC servers whose engine is a gate the test opens, so "while the
prompt is being computed" is a state the test holds, not a race it hopes to win."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services.procs import free_port
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from tests.integration.services.router_util import ServedRouter

TOKEN = 42  # what the gated worker "computes"


class GatedWorker(pb_grpc.WorkerServicer):
    """Accepts every request at once (initial metadata), then waits for `gate` before answering;
    with `fail`, it ends the call with INTERNAL instead."""

    def __init__(self, role: int) -> None:
        self.role = role
        self.gate = asyncio.Event()
        self.accepted = asyncio.Event()
        self.fail = False

    async def _accept_then_wait(self, context: grpc.aio.ServicerContext) -> None:
        await context.send_initial_metadata(())
        self.accepted.set()
        await self.gate.wait()
        if self.fail:
            await context.abort(grpc.StatusCode.INTERNAL, "the engine fell over")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrefillResponse:
        await self._accept_then_wait(context)
        return pb.PrefillResponse(first_token_id=TOKEN, finish_reason="")

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.DecodeChunk]:
        await self._accept_then_wait(context)
        for _ in range(request.params.max_tokens - request.num_output_tokens - 1):  # the whole sample's
            yield pb.DecodeChunk(token_ids=[TOKEN])
        yield pb.DecodeChunk(token_ids=[TOKEN], finish_reason="length",
                             usage=pb.Usage(prompt_tokens=len(request.token_ids), completion_tokens=1))

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return pb.LoadReport(role=self.role, serving=True)  # type: ignore[arg-type]


async def serve(worker: GatedWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def body(stream: bool = True) -> dict[str, object]:
    return {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": stream}


async def events(response: httpx.Response) -> list[str]:
    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.asyncio
async def test_stream_starts_when_a_worker_accepts_and_tokens_follow(model_dir: Path, mode: str) -> None:
    gated = GatedWorker(pb.ROLE_PREFILL if mode == "disaggregated" else pb.ROLE_COLOCATED)
    decode = GatedWorker(pb.ROLE_DECODE)
    decode.gate.set()  # after a prefill, only the prefill is held
    servers = [await serve(gated)] + ([await serve(decode)] if mode == "disaggregated" else [])
    targets = [t for _, t in servers]
    dispatch = (DispatchOptions(prefill=(targets[0],), decode=(targets[1],)) if mode == "disaggregated"
                else DispatchOptions(decode=(targets[0],)))
    try:
        with ServedRouter(RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=512,
                                       dispatch=dispatch)) as router:
            async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as http:
                async with http.stream("POST", "/completions", json=body()) as response:
                    # Headers are here while the gated worker still holds the first token.
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    assert gated.accepted.is_set() and not gated.gate.is_set()
                    gated.gate.set()
                    data = await asyncio.wait_for(events(response), 30)
                assert data[-1] == "[DONE]"
                chunks = [json.loads(d) for d in data[:-1]]
                assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
                assert all(c["choices"][0]["text"] is not None for c in chunks)
                # A non-streamed request waits for the whole answer, accepted or not.
                full = (await http.post("/completions", json=body(stream=False))).json()
                assert full["choices"][0]["finish_reason"] == "length"
                assert full["usage"]["completion_tokens"] == 3
    finally:
        for server, _ in servers:
            await server.stop(0)


@pytest.mark.asyncio
async def test_a_worker_failing_after_it_accepted_ends_the_stream_with_an_error_event(model_dir: Path
                                                                                      ) -> None:
    gated = GatedWorker(pb.ROLE_COLOCATED)
    gated.fail = True
    server, target = await serve(gated)
    try:
        with ServedRouter(RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=512,
                                       dispatch=DispatchOptions(decode=(target,)))) as router:
            async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as http, \
                    http.stream("POST", "/completions", json=body()) as response:
                assert response.status_code == 200
                gated.gate.set()
                data = await asyncio.wait_for(events(response), 30)
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert "the engine fell over" in error["message"]
    finally:
        await server.stop(0)
