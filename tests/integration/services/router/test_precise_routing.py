"""Precise prefix routing on real processes: two colocated workers that publish KV cache events,
and two routers over them, one scoring on the events (--prefix-index events, the default) and
one on its approximate index. Another client evicts a prompt from the worker the routers sent it
to and computes it on the other worker: the events router sends the prompt where it is cached
(the worker reports the hit), the approximate one where it is no longer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.sampling_params import SamplingParams
from services.procs import free_port
from services.worker.client import WorkerClient
from tests.integration.services.procs_util import Proc, router_proc, worker_proc

BLOCK = 16


def _events(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
                       "bind": True, "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "topic": "kv-events"})


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[tuple[list[Proc], Proc, Proc]]:
    workers = [worker_proc("colocated", model_dir, "grpc://127.0.0.1:1", "--num-kv-blocks", "20",
                           "--max-model-len", "256",
                           "--kv-events-config", _events(free_port()))
               for _ in range(2)]
    routers: list[Proc] = []
    try:
        for w in workers:
            w.wait_ready()
        targets = [w.target for w in workers]
        routers = [router_proc(model_dir, targets, "--prefix-index", source, "--max-model-len", "256")
                   for source in ("events", "approximate")]
        for r in routers:
            r.wait_ready()
        yield workers, routers[0], routers[1]
    finally:
        for p in [*routers, *workers]:
            p.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 5000 + 10 for i in range(n)]


async def _complete(router: Proc, prompt: list[int]) -> int:
    """The prompt through the router; the prompt tokens its worker found cached."""
    async with httpx.AsyncClient(base_url=f"http://{router.target}", timeout=60) as http:
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                     "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def _direct(target: str, prompt: list[int], rid: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    async with WorkerClient(target) as client:
        async for _ in client.decode(rid, prompt, params):
            pass


async def _cached_blocks(target: str) -> int:
    async with WorkerClient(target) as client:
        return int((await client.load()).num_cached_blocks)


@pytest.mark.asyncio(loop_scope="module")
async def test_events_route_to_the_worker_that_holds_the_prefix(
        stack: tuple[list[Proc], Proc, Proc]) -> None:
    workers, events, approximate = stack
    a = _prompt(1, 5 * BLOCK)
    # both routers send `a` to the same worker (both idle: the first)
    assert await _complete(approximate, a) == 0
    assert await _complete(events, a) == 4 * BLOCK  # (the events router saw it stored there)
    first, other = workers[0].target, workers[1].target
    # another client fills the first worker's 19 blocks with other prompts (`a` is evicted) and
    # computes `a` on the other worker
    for seed in range(2, 9):
        await _direct(first, _prompt(seed, 3 * BLOCK + 1), f"fill-{seed}")
    await _direct(other, a, "place")
    await asyncio.sleep(1.0)  # (load reports every 0.1 s; events arrive as they are published)
    assert await _complete(events, a) == 4 * BLOCK  # to the worker that holds it: a hit
    assert await _complete(approximate, a) == 0  # to where it was sent before: evicted, a miss
    assert await _cached_blocks(first) > 0 and await _cached_blocks(other) > 0
    # the routers' own account: what they expected the chosen worker to hold, and what it found
    assert await _prefix_tokens(events, "events") == (2 * 4 * BLOCK, 2 * 4 * BLOCK)
    assert await _prefix_tokens(approximate, "approximate") == (4 * BLOCK, 0)


async def _prefix_tokens(router: Proc, index: str) -> tuple[int, int]:
    """(expected, found) prompt tokens of the router's choices made on `index`."""
    async with httpx.AsyncClient(base_url=f"http://{router.target}", timeout=10) as http:
        text = (await http.get("/metrics")).text
    out = []
    for name in ("pdserve:router_prefix_expected_tokens_total", "pdserve:router_prefix_found_tokens_total"):
        out.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith(name + "{") and f'index="{index}"' in line)))
    return out[0], out[1]
