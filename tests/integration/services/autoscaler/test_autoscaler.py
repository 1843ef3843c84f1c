"""The autoscaler through the real router with bounded synthetic load (tiny model, worker processes
started and stopped by the local actuator): a burst of long prompts over the TTFT target grows the
prefill pool and not the decode pool; many concurrent decodes over the ITL target grow the decode
pool; idle load shrinks both back to their minimum by draining; steady load changes nothing; no
request fails throughout. Targets are set per phase so each phase breaks exactly one of them on
this noisy machine (absolute latencies of a tiny model say nothing)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from kvstore.service import KVStoreService
from services.autoscaler.actuators import LocalProcessActuator
from services.autoscaler.loop import Autoscaler, AutoscalerOptions
from services.autoscaler.observe import RouterObserver
from services.autoscaler.planner import Planner, PlannerConfig
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
LONG = list(range(1000, 1400))  # a 400-token prompt (ids in the tiny vocabulary)
HUGE = 1e9  # a target nothing breaks


class Load:
    """Closed-loop users sending requests until stopped; counts successes and failures."""

    def __init__(self, client: openai.AsyncOpenAI, users: int, prompt: list[int], max_tokens: int) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._user(client, prompt, max_tokens, u)) for u in range(users)]

    async def _user(self, client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, u: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                await client.completions.create(model=MODEL, prompt=[u, i % 50, *prompt],
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body={"ignore_eos": True})
                self.ok += 1
            except Exception as e:
                self.failed.append(f"{type(e).__name__}: {e}"[:200])
            i += 1

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout=120)


async def until(scaler: Autoscaler, check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s: {scaler.timeline[-3:]}"
        await asyncio.sleep(0.25)


@in_module_loop
async def test_pools_follow_the_load_and_shrink_by_draining(
        workers: dict[str, WorkerServer], model_dir: Path, store: KVStoreService, tmp_path: Path) -> None:
    dispatch = DispatchOptions(prefill=(workers["prefill"].target,), decode=(workers["decode"].target,),
                               prefill_policy="least_loaded", decode_policy="least_loaded")
    router_config = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch,
                                 worker_networks=("127.0.0.0/8",))  # the local actuator's workers
    base = PlannerConfig(ttft_ms=HUGE, itl_ms=HUGE, min_prefill=1, max_prefill=2, min_decode=1, max_decode=2,
                         prefill_tokens_per_s=1e9, up_intervals=2, down_intervals=3, up_cooldown_s=1,
                         down_cooldown_s=2)
    actuator = LocalProcessActuator(["--kv-store-url", store.location, "--model", str(model_dir),
                                     "--num-threads", "1", "--max-model-len", "512", "--num-kv-blocks", "96"],
                                    startup_timeout_s=120)
    with ServedRouter(router_config) as served:
        observer = RouterObserver(served.url)
        planner = Planner(base)
        scaler = Autoscaler(observer, planner, actuator,
                            AutoscalerOptions(interval_s=0.5, log_path=tmp_path / "autoscaler.jsonl"))
        stop = asyncio.Event()
        loop = asyncio.create_task(scaler.run(stop))
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=60)

        def count(role: str) -> int:
            return len(actuator.managed(role)) + 1

        failed: list[str] = []
        try:
            # 1. A burst of long prompts over the TTFT target: prefill grows, decode does not.
            planner.config = replace(base, ttft_ms=1.0)
            load = Load(client, users=4, prompt=LONG, max_tokens=2)
            await until(scaler, lambda: count("prefill") == 2, 90, "prefill grown to 2")
            await load.stop()
            failed += load.failed
            assert count("decode") == 1
            grown = [d for row in scaler.timeline for d in row["decisions"]]
            assert {d["pool"] for d in grown} == {"prefill"} and "TTFT p90" in grown[0]["reason"]

            # 2. Many concurrent decodes over the ITL target: decode grows.
            planner.config = replace(base, itl_ms=1.0, down_intervals=10_000)
            load = Load(client, users=8, prompt=[5, 6, 7], max_tokens=48)
            await until(scaler, lambda: count("decode") == 2, 90, "decode grown to 2")
            await load.stop()
            failed += load.failed
            assert count("prefill") == 2

            # 3. Idle, with a trickle of requests during the drains: both shrink to their minimum.
            planner.config = base
            trickle = Load(client, users=1, prompt=[9, 9, 9], max_tokens=24)
            await until(scaler, lambda: count("prefill") == 1 and count("decode") == 1, 90, "shrunk to 1 + 1")
            await trickle.stop()
            failed += trickle.failed
            downs = [d for row in scaler.timeline for d in row["decisions"] if d["target"] < d["current"]]
            assert sorted(d["pool"] for d in downs) == ["decode", "prefill"]

            # 4. Steady load within the targets: nothing changes.
            before = len([d for row in scaler.timeline for d in row["decisions"]])
            steady = Load(client, users=2, prompt=[3, 4, 5], max_tokens=8)
            await asyncio.sleep(6)
            await steady.stop()
            failed += steady.failed
            after = [d for row in scaler.timeline for d in row["decisions"]]
            assert len(after) == before, after[before:]
        finally:
            stop.set()
            await asyncio.wait_for(loop, timeout=120)
            await actuator.close()
            await observer.close()
            await client.close()
        assert failed == []
        assert (tmp_path / "autoscaler.jsonl").read_text().count("\n") == len(scaler.timeline)
