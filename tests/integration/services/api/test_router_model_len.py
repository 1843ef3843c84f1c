"""A router without --max-model-len serves the max_model_len its workers report (the smallest of
them), not a default of its own: prompts the workers take are not refused at the edge, and those
they cannot take are a 400 naming the limit. With one configured, it serves at most that.
`/v1/models` reports the same limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.router.app import RouterConfig
from services.router.config import DEFAULT_MAX_MODEL_LEN
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
WORKER_LEN = 512  # the workers' engines (tests/integration/services/conftest.py)


@pytest.fixture(params=[None, 300], ids=["learned", "configured"])
def router(request: pytest.FixtureRequest, colocated_worker: WorkerServer, model_dir: Path
           ) -> Iterator[ServedRouter]:
    dispatch = DispatchOptions(decode=(colocated_worker.target,), decode_timeout_s=60)
    config = RouterConfig(model="tiny", tokenizer=str(model_dir), max_model_len=request.param,
                          dispatch=dispatch)
    with ServedRouter(config) as served:
        yield served


async def served_len(http: httpx.AsyncClient, url: str) -> int:
    r = await http.post(f"{url}/tokenize", json={"prompt": "hi"})
    return int(r.json()["max_model_len"])


@in_module_loop
async def test_the_router_serves_what_its_workers_can(router: ServedRouter) -> None:
    configured = router.config.max_model_len  # type: ignore[union-attr]
    want = min(WORKER_LEN, configured or WORKER_LEN)
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(100):  # the first load report (every 0.1 s)
            if await served_len(http, router.url) == want:
                break
            await asyncio.sleep(0.1)
        assert await served_len(http, router.url) == want != DEFAULT_MAX_MODEL_LEN
        for path in ("/v1/models", "/v1/models/tiny"):  # vLLM's model card carries the limit too
            r = await http.get(f"{router.url}{path}")
            card = r.json()["data"][0] if path == "/v1/models" else r.json()
            assert card["max_model_len"] == want and card["id"] == "tiny", card
            assert abs(card["created"] - time.time()) < 600
        fits = {"model": "tiny", "prompt": [100 + i for i in range(want - 4)], "max_tokens": 4,
                "temperature": 0}
        r = await http.post(f"{router.url}/v1/completions", json=fits)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        too_long = {**fits, "prompt": [100 + i for i in range(want + 1)], "max_tokens": 1}
        r = await http.post(f"{router.url}/v1/completions", json=too_long)
        assert r.status_code == 400 and f"max_model_len={want}" in r.json()["error"]["message"], r.text
        r = await http.post(f"{router.url}/v1/completions", json={**fits, "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
