"""A KV store killed (SIGKILL) under 8 streams, its port then taken by a listener that answers
nothing (as a store restarting on it looks for a while: calls to it run into their timeout), does
not stall them: the streams need nothing from the store once their KV is loaded, so every gap
between their tokens stays under 2 s (the workers' store timeout is its default, 10 s) while 4
transfers prefilled before the kill arrive at the decode worker and find the store silent (their
loads would run inside the decode step: they give up within kv_load_wait_s, 0.5 s, and recompute), and
every text is the greedy one. Real processes: `pdserve kvstore`, a prefill and a decode `pdserve
worker`, `pdserve router`."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.sampling_params import SamplingParams
from services.worker.client import PrefillResult, WorkerClient
from tests.integration.services.procs_util import Proc, router_proc, store_proc, worker_proc

in_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPTS = [f"Stream {i} of the store test: " + "words " * (20 + 6 * i) for i in range(8)]
LATE = [[300 + (13 * i + 7 * j) % 4000 for j in range(40 + 10 * i)] for i in range(4)]
NEW_TOKENS = 360
LATE_TOKENS = 24
GAP_BOUND_S = 2.0
STORE_WAIT_S = 9.0  # under the store wait this guards against (10 s before the fix)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> tuple[list[str], list[list[int]]]:
    from engine.llm import LLM

    with LLM(model=str(model_dir), num_threads=1, max_model_len=512, num_kv_blocks=96) as llm:
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(NEW_TOKENS), use_tqdm=False)]
        late = [list(o.outputs[0].token_ids) for o in llm.generate(LATE, greedy(LATE_TOKENS), use_tqdm=False)]
    return texts, late


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("logs")
    procs = {"store": store_proc().wait_ready()}
    url = f"grpc://{procs['store'].target}"
    try:
        for role in ("prefill", "decode"):
            procs[role] = worker_proc(role, model_dir, url, log=logs / f"{role}.log")
        for role in ("prefill", "decode"):
            procs[role].wait_ready()
        procs["router"] = router_proc(model_dir, [procs["decode"].target], "--max-model-len", "512",
                                      prefill=(procs["prefill"].target,)).wait_ready()
        yield procs
    finally:
        for proc in reversed(procs.values()):
            if proc.proc.poll() is None:
                proc.stop()


async def stream(http: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event,
                 gaps: list[float]) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text: list[str] = []
    last = time.monotonic()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if text:
                gaps.append(now - last)
            last = now
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if len(text) >= 8:
                started.set()
    return "".join(text)


async def late_decode(decode: WorkerClient, i: int, first: int, kv: dict[str, object]) -> list[int]:
    rest = [t async for c in decode.decode(f"late-{i}", [*LATE[i], first], greedy(LATE_TOKENS - 1), kv)
            for t in c.token_ids]
    return [first, *rest]


async def run_streams(url: str, decode: WorkerClient, gaps: list[float], strike: object,
                      firsts: list[PrefillResult]) -> tuple[list[str], list[list[int]], int]:
    """The 8 streams; once each has 8 tokens, `strike()` (returning what to close after), then
    the 4 prefilled transfers on the decode worker. Returns the texts, the late tokens and how
    many gaps came before the strike."""
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(stream(http, url, p, s, gaps)) for p, s in zip(PROMPTS, started,
                                                                                     strict=True)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), timeout=120)
        before = len(gaps)
        after_strike = strike()  # type: ignore[operator]
        try:
            late = await asyncio.wait_for(asyncio.gather(*(
                late_decode(decode, i, f.first_token_id, f.kv_transfer_params or {})
                for i, f in enumerate(firsts))), timeout=120)
            texts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        finally:
            after_strike.close()
    return texts, late, before


@in_module_loop
async def test_a_killed_store_leaves_the_streams_gaps_under_2_s(
        stack: dict[str, Proc], expected: tuple[list[str], list[list[int]]]) -> None:
    """The same load twice: without a fault (the machine's own gaps), then with the store killed.
    On a quiet machine every gap stays far under 2 s; on one whose cores are busy elsewhere the
    streams' own gaps approach 2 s (seen: 1.9 s with two CPU-burning processes beside; 1.24 s in a
    CI run whose other test process was busy, then 2.03 s after the kill), so the bound is 2 s or
    those plus 1 s (the fault may add a load's kv_load_wait_s, 0.5 s, to a step), whichever is
    larger: a store wait (10 s before this fix) exceeds both. On a slower CPU with the other test
    process busy the fault-free gaps reached 4.5 s and the same load after the kill 5.7 s (a CI
    run on an AVX-512 Xeon without BF16): the load's own gaps vary by a quarter between the two
    runs, so the bound takes the larger of 2 s and 1.25x those plus 1 s, and stays under the 10 s
    store wait whatever the load."""
    url = f"http://{stack['router'].target}"
    async with WorkerClient(stack["prefill"].target) as prefill, \
            WorkerClient(stack["decode"].target) as decode:
        firsts = [await prefill.prefill(f"base-{i}", p, greedy(1), transfer_id=f"base-{i}")
                  for i, p in enumerate(LATE)]
        base: list[float] = []
        texts, late, _ = await run_streams(url, decode, base, lambda: socket.socket(), firsts)
        assert texts == expected[0] and late == expected[1]
        firsts = [await prefill.prefill(f"late-{i}", p, greedy(1), transfer_id=f"late-{i}")
                  for i, p in enumerate(LATE)]  # their KV is in the store before the kill

        def kill() -> socket.socket:
            old = stack["store"]
            old.signal(signal.SIGKILL)  # every stream is past its KV load
            old.proc.wait()
            # A store restarting on its port looks like this for a while: calls time out.
            return socket.create_server(("127.0.0.1", int(old.target.rsplit(":", 1)[1])), backlog=64)

        gaps: list[float] = []
        texts, late, before = await run_streams(url, decode, gaps, kill, firsts)
    after, bound = gaps[before:], min(max(GAP_BOUND_S, 1.25 * max(base) + 1.0), STORE_WAIT_S)
    print(f"gaps of the 8 streams: without a fault max {max(base):.3f} s; after the store's kill "
          f"({len(after)}) max {max(after):.3f} s; bound {bound:.2f} s")
    assert texts == expected[0]
    assert late == expected[1]
    assert after and max(after) < bound, sorted(after)[-5:]
