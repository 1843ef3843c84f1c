"""Faults under load: a prefill worker process killed with SIGKILL while requests stream through the
router. Every request still completes with the right text (retried on the other prefill worker, or
computed by the decode worker), the router marks the dead worker unhealthy and sends it nothing
more."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.sampling_params import SamplingParams
from kvstore.service import KVStoreService
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter, free_port

in_module_loop = pytest.mark.asyncio(loop_scope="module")
ROOT = Path(__file__).resolve().parents[4]
MODEL = "tiny"
PROMPTS = [f"Request number {i} says" for i in range(6)]
NEW_TOKENS = 6


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"worker {target} exited with {proc.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"worker {target} not serving after {timeout_s} s")


@pytest.fixture(scope="module")
def prefill_procs(model_dir: Path, store: KVStoreService
                  ) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Two `pdserve worker --role prefill` processes on the tiny model."""
    procs = []
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "worker", "--role", "prefill", "--port", str(port),
                 "--kv-store-url", store.location, "--model", str(model_dir), "--num-threads", "1",
                 "--max-model-len", "512", "--num-kv-blocks", "96"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            procs.append((f"127.0.0.1:{port}", proc))
        for target, proc in procs:
            wait_serving(target, proc)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False),
                                                     strict=True)}


@in_module_loop
async def test_sigkill_of_a_prefill_worker_under_load_loses_no_request(
        prefill_procs: list[tuple[str, subprocess.Popen[bytes]]], workers: dict[str, WorkerServer],
        model_dir: Path, expected: dict[str, str]) -> None:
    (victim, victim_proc), (survivor, _) = prefill_procs
    dispatch = DispatchOptions(prefill=(victim, survivor), decode=(workers["decode"].target,),
                               prefill_policy="least_loaded", prefill_timeout_s=20, decode_timeout_s=60)
    config = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch)
    results: list[tuple[str, str]] = []
    with ServedRouter(config) as served:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0,
                                      timeout=60) as client:

            async def user(u: int, n: int) -> None:
                for i in range(n):
                    prompt = PROMPTS[(u + i) % len(PROMPTS)]
                    stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                             max_tokens=NEW_TOKENS, stream=True)
                    text = "".join([c.choices[0].text async for c in stream if c.choices])
                    results.append((prompt, text))

            users = [asyncio.create_task(user(u, 12)) for u in range(4)]
            deadline = time.monotonic() + 60
            while served.metric("pdserve:worker_requests_dispatched", worker=victim) < 4:
                assert time.monotonic() < deadline, "the victim never got requests"
                await asyncio.sleep(0.02)
            victim_proc.send_signal(signal.SIGKILL)  # mid-load: requests are in flight
            await asyncio.wait_for(asyncio.gather(*users), timeout=120)

            assert len(results) == 48
            assert all(text == expected[prompt] for prompt, text in results)
            assert served.metric("pdserve:worker_healthy", worker=victim) == 0
            assert served.metric("pdserve:worker_healthy", worker=survivor) == 1
            sent_to_victim = served.metric("pdserve:worker_requests_dispatched", worker=victim)
            after = await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0) for p in PROMPTS))
            assert [o.choices[0].text for o in after] == [expected[p] for p in PROMPTS]
            assert served.metric("pdserve:worker_requests_dispatched", worker=victim) == sent_to_victim
            assert served.metric("pdserve:router_decisions_total", decision="disaggregated") >= 48
