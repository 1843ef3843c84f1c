"""A client that disconnects mid-stream: the router cancels the decode call, the worker aborts the
request (it does not run on to max_tokens), and every worker is back to its idle load (nothing
running, all KV blocks free) within seconds. Over a prefill + decode pair and over a colocated
worker (tiny model, workers in this process, the router under uvicorn in a thread).

The same when the call ends while grpc.aio's handler waits at a chunk it is sending, which leaves
the handler suspended until it is collected: the worker aborts and records the call's span when
the call ends; a decode that sent its last chunk is complete, whenever its caller closes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from services import tracing
from services.router.app import RouterConfig, create_app
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.e2e_util import load_of, wait_for_load
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
PROMPT = "The capital of France is"
MAX_TOKENS = 400
CHUNKS_BEFORE_DISCONNECT = 3
IDLE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def full_length(model_dir: Path) -> int:
    """Precondition: the offline greedy run of PROMPT goes all the way to MAX_TOKENS (no EOS), so a
    request that stops early was aborted."""
    from engine.llm import LLM

    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, len(out.token_ids)) == ("length", MAX_TOKENS)
    return MAX_TOKENS


@dataclass(frozen=True)
class Setup:
    router: ServedRouter
    roles: tuple[str, ...]  # the workers this router uses
    decoder: str  # the role that runs the decode


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def setup(request: pytest.FixtureRequest, full_length: int, workers: dict[str, WorkerServer],
          model_dir: Path) -> Iterator[Setup]:
    # `full_length` first: the offline run blocks this event loop, where the workers serve; run while
    # they serve, it would starve their Load calls and the router would mark them unhealthy.
    if request.param == "disaggregated":
        dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,),
                                   prefill_timeout_s=30, decode_timeout_s=120)
        roles: tuple[str, ...] = ("prefill", "decode")
        decoder = "decode"
    else:
        dispatch = DispatchOptions(decode=(workers["colocated"].target,), decode_timeout_s=120)
        roles, decoder = ("colocated",), "colocated"
    app = create_app(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                  dispatch=dispatch))
    with ServedRouter(app) as served:
        yield Setup(served, roles, decoder)


async def generated_tokens(worker: WorkerServer) -> int:
    engine = worker.servicer.engine
    assert engine is not None
    return (await engine.get_stats()).num_generation_tokens


@in_module_loop
async def test_a_client_disconnecting_mid_stream_aborts_the_request_and_frees_every_block(
        full_length: int, setup: Setup, workers: dict[str, WorkerServer]) -> None:
    targets = {role: workers[role].target for role in setup.roles}
    for target in targets.values():  # idle before: nothing left over from an earlier test
        load = await load_of(target)
        await wait_for_load(target, load.num_total_blocks, timeout_s=IDLE_TIMEOUT_S)
    start_free = {role: (await load_of(t)).num_free_blocks for role, t in targets.items()}
    decoder = workers[setup.decoder]
    generated_before = await generated_tokens(decoder)

    async with openai.AsyncOpenAI(base_url=setup.router.base_url, api_key="x", max_retries=0,
                                  timeout=60) as client:
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        received: list[str] = []
        async for chunk in stream:
            assert chunk.choices[0].finish_reason is None, "the request ended before the disconnect"
            received.append(chunk.choices[0].text)
            if len(received) == CHUNKS_BEFORE_DISCONNECT:
                break
        mid_stream = await load_of(targets[setup.decoder])
        mid_generated = await generated_tokens(decoder) - generated_before
        await stream.close()  # drops the HTTP connection
        closed_at = time.monotonic()

    assert mid_stream.num_running == 1, "the request should still be decoding when the client leaves"
    assert mid_stream.num_free_blocks < start_free[setup.decoder]
    for role, target in targets.items():
        load = await wait_for_load(target, start_free[role], timeout_s=IDLE_TIMEOUT_S)
        assert load.num_free_blocks == load.num_total_blocks, (role, load)
    idle_after_s = time.monotonic() - closed_at
    generated = await generated_tokens(decoder) - generated_before
    assert generated < full_length // 2, (
        f"the {setup.decoder} worker generated {generated} of {full_length} tokens after the client left "
        f"({mid_generated} when it left, idle {idle_after_s:.2f} s later): not aborted")


class HeldCall:
    """A ServicerContext for calling a worker's Decode directly, whose call ends when the test
    says (`end()` runs the done callbacks), with the handler still suspended at a `yield` and
    still referenced: what grpc.aio leaves when the call ends while it sends a chunk, until the
    handler generator is collected (services/worker/call_end.py)."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"the call failed: {code.name}: {details}")

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The worker's spans in this process, kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter


def held_decode(worker: WorkerServer, request_id: str, max_tokens: int, call: HeldCall) -> Any:
    request = pb.DecodeRequest(request_id=request_id, token_ids=list(range(40, 60)), params=pb.SamplingParams(
        top_p=1.0, top_k=-1, max_tokens=max_tokens, repetition_penalty=1.0, ignore_eos=True))
    return worker.servicer.Decode(request, call)


def worker_spans(spans: InMemorySpanExporter, request_id: str) -> list[Any]:
    return [s for s in spans.get_finished_spans()
            if s.name == "worker decode" and (s.attributes or {}).get("pdserve.request_id") == request_id]


@in_module_loop
async def test_a_call_ended_while_its_handler_waits_at_a_chunk_aborts_its_request_at_once(
        workers: dict[str, WorkerServer], spans: InMemorySpanExporter) -> None:
    worker = workers["colocated"]
    total = (await load_of(worker.target)).num_total_blocks
    await wait_for_load(worker.target, total, timeout_s=IDLE_TIMEOUT_S)
    generated_before = await generated_tokens(worker)
    call = HeldCall()
    handler = held_decode(worker, "held-mid-stream", MAX_TOKENS, call)
    for _ in range(CHUNKS_BEFORE_DISCONNECT):
        assert not (await anext(handler)).finish_reason
    call.end()  # `handler` is still referenced and suspended: it never runs again
    try:
        await wait_for_load(worker.target, total, timeout_s=IDLE_TIMEOUT_S)
        assert await generated_tokens(worker) - generated_before < MAX_TOKENS // 2
        [span] = worker_spans(spans, "held-mid-stream")
        assert span.attributes["pdserve.cancelled"] is True and span.status.is_ok
    finally:
        await handler.aclose()
    assert len(worker_spans(spans, "held-mid-stream")) == 1  # its own end records nothing more


@in_module_loop
async def test_a_decode_that_sent_its_last_chunk_is_complete_when_its_caller_closes_the_stream(
        workers: dict[str, WorkerServer], spans: InMemorySpanExporter) -> None:
    call = HeldCall()
    handler = held_decode(workers["colocated"], "held-last-chunk", 4, call)
    try:
        chunks = [await anext(handler)]
        while not chunks[-1].finish_reason:
            chunks.append(await anext(handler))
        assert chunks[-1].usage.completion_tokens == 4
        [span] = worker_spans(spans, "held-last-chunk")  # before the handler runs again
        assert span.attributes["pdserve.cancelled"] is False and span.status.is_ok
        assert span.attributes["pdserve.generated_tokens"] == 4
        call.end()  # the caller closed the stream on that chunk
        await asyncio.sleep(0.2)
        assert len(worker_spans(spans, "held-last-chunk")) == 1
    finally:
        await handler.aclose()
