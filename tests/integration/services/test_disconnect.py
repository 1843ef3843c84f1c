"""A client that disconnects mid-stream: the router cancels the decode call, the worker aborts the
request (it does not run on to max_tokens), and every worker is back to its idle load (nothing
running, all KV blocks free) within seconds. Over a prefill + decode pair and over a colocated
worker (tiny model, workers in this process, the router under uvicorn in a thread)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from engine.sampling_params import SamplingParams
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
