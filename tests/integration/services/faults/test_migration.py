"""Request migration: with a prefill worker and two decode workers (real processes), a store and the
router, seeded sampled streams with penalties whose decode worker is frozen (SIGSTOP) past the
stall timeout, or killed (SIGKILL), mid-stream, finish on the other worker with exactly the text
of an undisturbed offline run: no error event, no token repeated or missing, no draw changed (a
seeded draw depends on its output position only, and the new worker counts the streamed tokens
as outputs for the penalties). The frozen worker, once it wakes, sends nothing into
the moved streams (the router cancelled its calls; it aborts them and is idle again)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.sampling_params import SamplingParams
from kvstore.service import KVStoreService
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from tests.integration.services.e2e_util import load_of
from tests.integration.services.procs_util import Proc, worker_proc
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
PROMPTS = [f"Stream number {i} tells a long story about" for i in range(6)]
NEW_TOKENS = 200
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "presence_penalty": 0.5, "frequency_penalty": 0.5}


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    from engine.llm import LLM

    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, seed=i, **SAMPLING)
              for i in range(len(PROMPTS))]
    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def procs(model_dir: Path, store: KVStoreService, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("migration-logs")
    started = {"prefill": worker_proc("prefill", model_dir, store.location, log=logs / "prefill.log"),
               "decode-a": worker_proc("decode", model_dir, store.location, log=logs / "decode-a.log"),
               "decode-b": worker_proc("decode", model_dir, store.location, log=logs / "decode-b.log")}
    try:
        for p in started.values():
            p.wait_ready()
        yield started
    finally:
        for p in started.values():
            p.stop()


@pytest.fixture(scope="module")
def router(procs: dict[str, Proc], model_dir: Path) -> Iterator[ServedRouter]:
    dispatch = DispatchOptions(prefill=(procs["prefill"].target,),
                               decode=(procs["decode-a"].target, procs["decode-b"].target),
                               decode_policy="least_loaded", stall_timeout_s=1.5, prefill_timeout_s=30,
                               decode_timeout_s=90)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


async def idle_and_back(router: ServedRouter, victim: Proc, *others: Proc) -> None:
    """Waits (30 s at most) until the woken `victim` and `others` hold no request and no block,
    and the router counts the victim healthy again."""
    deadline = time.monotonic() + 30
    for p in (victim, *others):
        while True:
            load = await load_of(p.target)
            if (load.num_running, load.num_waiting) == (0, 0) and \
                    load.num_free_blocks == load.num_total_blocks:
                break
            assert time.monotonic() < deadline, load
            await asyncio.sleep(0.1)
    while router.metric("pdserve:worker_healthy", worker=victim.target) != 1:
        assert time.monotonic() < deadline, "the woken worker never rejoined its pool"
        await asyncio.sleep(0.1)


async def run_streams_and_strike(router: ServedRouter, procs: dict[str, Proc], sig: int
                                 ) -> tuple[dict[str, str], Proc]:
    """Streams every prompt; once each has tokens, sends `sig` to the decode worker holding the
    most streams. Returns each prompt's text and the struck worker."""
    progress = dict.fromkeys(PROMPTS, 0)
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=90) as client:

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, stream=True,
                seed=PROMPTS.index(prompt), temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"],
                presence_penalty=SAMPLING["presence_penalty"],
                frequency_penalty=SAMPLING["frequency_penalty"], extra_body={"ignore_eos": True})
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text
                progress[prompt] += 1
            return text

        tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while min(progress.values()) < 3:
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), progress
            await asyncio.sleep(0.01)
        def inflight(p: Proc) -> float:
            return router.metric("pdserve:worker_requests_inflight", worker=p.target)

        victim = max([procs["decode-a"], procs["decode-b"]], key=inflight)
        assert inflight(victim) >= 1
        victim.signal(sig)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    assert all(progress[p] > 3 for p in PROMPTS)
    return dict(zip(PROMPTS, texts, strict=True)), victim


@in_module_loop
async def test_a_frozen_decode_worker_s_streams_move_and_it_sends_nothing_when_it_wakes(
        router: ServedRouter, procs: dict[str, Proc], expected: dict[str, str]) -> None:
    before = router.metric("pdserve:router_migrations_total")
    texts, victim = await run_streams_and_strike(router, procs, signal.SIGSTOP)
    try:
        assert texts == expected
        moved = router.metric("pdserve:router_migrations_total") - before
        assert moved >= 1
        assert (router.metric("pdserve:router_migrations_total", reason="stalled")
                + router.metric("pdserve:router_migrations_total", reason="unhealthy")) >= moved
    finally:
        victim.signal(signal.SIGCONT)
    # Awake, it sees the router's cancellations: it aborts those requests and is idle again.
    await idle_and_back(router, victim)


@in_module_loop
async def test_early_decode_calls_to_a_frozen_worker_fall_back_to_the_other_with_the_same_text(
        router: ServedRouter, procs: dict[str, Proc], expected: dict[str, str]) -> None:
    """A decode worker frozen just before the requests come (the router still counts it healthy
    for a moment): the early decode calls sent to it with their prefills are never accepted, so
    after the stall timeout each sample hands off after its prefill instead, on the other worker,
    with the undisturbed text."""
    victim, other = procs["decode-a"], procs["decode-b"]
    early_before = router.metric("pdserve:handoff_seconds_count", mode="early")
    plain_before = router.metric("pdserve:handoff_seconds_count", mode="after_prefill")
    victim.freeze()
    try:
        async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                      timeout=90) as client:
            async def one(prompt: str) -> str:
                out = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, seed=PROMPTS.index(prompt),
                    temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"],
                    presence_penalty=SAMPLING["presence_penalty"],
                    frequency_penalty=SAMPLING["frequency_penalty"], extra_body={"ignore_eos": True})
                return out.choices[0].text

            texts = await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), timeout=120)
        assert dict(zip(PROMPTS, texts, strict=True)) == expected
        early = router.metric("pdserve:handoff_seconds_count", mode="early") - early_before
        plain = router.metric("pdserve:handoff_seconds_count", mode="after_prefill") - plain_before
        assert early + plain == len(PROMPTS)
        assert plain >= 1, "no early call went to the frozen worker: the fallback was not exercised"
    finally:
        victim.signal(signal.SIGCONT)
    await idle_and_back(router, victim, other)  # the cancelled early calls leave nothing behind


@in_module_loop
async def test_streams_of_a_killed_decode_worker_finish_on_the_other_with_the_same_text(
        router: ServedRouter, procs: dict[str, Proc], expected: dict[str, str]) -> None:
    before = router.metric("pdserve:router_migrations_total")
    texts, victim = await run_streams_and_strike(router, procs, signal.SIGKILL)
    assert texts == expected
    assert router.metric("pdserve:router_migrations_total") - before >= 1
    assert router.metric("pdserve:worker_healthy", worker=victim.target) == 0
    survivor = procs["decode-b"] if victim is procs["decode-a"] else procs["decode-a"]
    load = await load_of(survivor.target)
    assert load.serving and load.num_running == 0

