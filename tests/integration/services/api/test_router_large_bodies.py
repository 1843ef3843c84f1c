"""Large bodies under the size limit never hold the router (real processes: a `pdserve worker` and a
`pdserve router` with its liveness port). While streams run back to back, a chat with 128 tools of
60 KB descriptions (7.7 MB), one with 250,000 empty messages (8.25 MB) and five tool bodies at
once are refused with 400s naming the field (or 429 beyond the caller's share): every stream gap
stays under 1 s, /livez answers within 1 s on both ports, and the router is the same process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvstore.service import KVStoreService
from services.procs import free_port
from tests.integration.services.procs_util import Proc, router_proc, worker_proc

in_module_loop = pytest.mark.asyncio(loop_scope="module")
BOUND_S = 1.0


@pytest.fixture(scope="module")
def stack(model_dir: Path, store: KVStoreService) -> Iterator[tuple[Proc, int]]:
    worker = worker_proc("colocated", model_dir, store.location).wait_ready()
    liveness = free_port()
    router = router_proc(model_dir, [worker.target], "--max-model-len", "512",
                         "--liveness-port", str(liveness), "--chat-template", "hermes_tools",
                         "--tool-call-parser", "hermes", "--enable-auto-tool-choice")  # as pdserve up
    try:
        router.wait_ready()
        yield router, liveness
    finally:
        router.stop()
        worker.stop()


def tools_body() -> bytes:
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 60_000,
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(128)]
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "tools": tools}).encode()


def messages_body() -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": ""}] * 250_000}).encode()


class Watch:
    """Streams back to back and /livez on both ports, timed, until stopped."""

    def __init__(self, url: str, live_url: str) -> None:
        self.url, self.live_url = url, live_url
        self.gaps: list[float] = []  # each stream's wait for its first chunk, and between chunks
        self.livez: dict[str, list[float]] = {"api": [], "liveness": []}
        self.streams = 0
        self.stop = asyncio.Event()

    async def stream_forever(self, http: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
                "stream": True}
        while not self.stop.is_set():
            last = time.monotonic()
            async with http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        self.gaps.append(now - last)
                        last = now
            self.streams += 1

    async def probe_forever(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            for name, url in (("api", self.url), ("liveness", self.live_url)):
                start = time.monotonic()
                r = await http.get(f"{url}/livez")
                assert r.status_code == 200 and r.json()["status"] == "alive"
                self.livez[name].append(time.monotonic() - start)
            await asyncio.sleep(0.05)


@in_module_loop
async def test_large_bodies_leave_streams_and_liveness_alone(stack: tuple[Proc, int]) -> None:
    router, liveness = stack
    url, pid = f"http://{router.target}", router.pid
    watch = Watch(url, f"http://127.0.0.1:{liveness}")
    bodies = {"tools": tools_body(), "messages": messages_body()}
    assert all(len(b) < 8 * 2**20 for b in bodies.values())  # under the router's body limit
    async with httpx.AsyncClient(timeout=60) as http, httpx.AsyncClient(timeout=60) as attacker:
        tasks = [asyncio.create_task(watch.stream_forever(http)),
                 asyncio.create_task(watch.probe_forever(http))]
        await asyncio.sleep(0.5)
        try:
            for field, body in bodies.items():
                r = await attacker.post(f"{url}/v1/chat/completions", content=body,
                                        headers={"content-type": "application/json"})
                assert r.status_code == 400, r.text[:300]
                assert r.json()["error"]["param"] == "messages", r.text[:300]
                # the tools: their characters count toward the prompt; the messages: their count
                assert ("and tools" if field == "tools" else "messages, more than") in \
                    r.json()["error"]["message"], r.text[:300]
            five = await asyncio.gather(*(attacker.post(f"{url}/v1/chat/completions",
                                                        content=bodies["tools"],
                                                        headers={"content-type": "application/json"})
                                          for _ in range(5)))
            assert {r.status_code for r in five} <= {400, 429}, [r.text[:200] for r in five]
            assert sum(r.status_code == 400 for r in five) >= 2  # the caller's share was served
            await asyncio.sleep(0.5)
        finally:
            watch.stop.set()
            await asyncio.gather(*tasks)
    print(f"streams {watch.streams}, max gap {max(watch.gaps):.3f} s, max /livez "
          f"{max(watch.livez['api']):.3f} s (API port), {max(watch.livez['liveness']):.3f} s (liveness port)")
    assert watch.streams >= 1 and watch.gaps
    assert max(watch.gaps) < BOUND_S, sorted(watch.gaps)[-5:]
    for name, times in watch.livez.items():
        assert times and max(times) < BOUND_S, (name, sorted(times)[-5:])
    assert router.proc.poll() is None and router.pid == pid


@in_module_loop
async def test_a_large_valid_body_is_served(stack: tuple[Proc, int]) -> None:
    """A batch of 100 token-id prompts (~300 KB: over heavy_bytes, prepared in the pool under the
    caller's share) gets every choice."""
    router, _ = stack
    prompts = [[10000 + (i * 7 + j) % 30000 for j in range(480)] for i in range(100)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0}
    assert len(json.dumps(body)) > 256 * 1024
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"http://{router.target}/v1/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(100))
    assert r.json()["usage"]["prompt_tokens"] == 100 * 480
