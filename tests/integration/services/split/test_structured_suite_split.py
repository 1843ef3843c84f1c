"""The structured-output suite (tests/integration/structured_schemas.py: 32 JSON schemas, regexes,
choice lists) on the DEFAULT model through the router and the official `openai` client, split
(prefill worker -> KV store -> decode worker) and colocated, greedy and seeded temperature 1.0:
every output validates (jsonschema with a format checker, regex fullmatch, one of the choices),
ends with "stop", and the split output equals the colocated one text for text.

JSON cases go as OpenAI's `response_format` json_schema, the others as vLLM's
`structured_outputs`. Three default-model workers and the whole suite take minutes on two CPU
cores: `slow` (run with --runslow); the engine-level suite and the tiny-model split tests
(test_structured_outputs.py) run by default.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from kvstore.service import KVStoreService
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.conftest import engine_config, running_together, worker_options
from tests.integration.services.router_util import ServedRouter, serving
from tests.integration.structured_schemas import CASES, MAX_TOKENS, Case

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL_LEN = 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(default_model_dir: Path, store: KVStoreService) -> AsyncIterator[dict[str, WorkerServer]]:
    config = replace(engine_config(default_model_dir, store.location), max_model_len=MODEL_LEN,
                     num_kv_blocks=2 * len(CASES) * (MODEL_LEN // 16) // 4)
    specs = {role: replace(worker_options(default_model_dir, store, role), engine=config)
             for role in ("prefill", "decode", "colocated")}
    async with running_together({name: WorkerServer(o) for name, o in specs.items()}) as started:
        yield started


@pytest.fixture(scope="module")
def routers(workers: dict[str, WorkerServer], default_model_dir: Path) -> Iterator[dict[str, ServedRouter]]:
    def config(decode: str, prefill: tuple[str, ...] = ()) -> RouterConfig:
        return RouterConfig(model="m", tokenizer=str(default_model_dir), max_model_len=MODEL_LEN,
                            dispatch=DispatchOptions(prefill=prefill, decode=(decode,), decode_timeout_s=300))

    with serving({"colocated": config(workers["colocated"].target),
                  "split": config(workers["decode"].target, (workers["prefill"].target,))}) as served:
        yield served


def _constraint(case: Case) -> dict[str, Any]:
    if case.kind == "json":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": case.name, "schema": case.spec, "strict": True}}}
    return {"extra_body": {"structured_outputs": case.structured_outputs()}}


async def _ask(client: openai.AsyncOpenAI, case: Case, seed: int | None) -> tuple[str, str]:
    kw = _constraint(case)
    extra = kw.pop("extra_body", {})
    reply = await client.chat.completions.create(
        model="m", messages=case.messages(), max_tokens=MAX_TOKENS, temperature=0.0 if seed is None else 1.0,
        seed=seed, extra_body=extra, **kw)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
async def test_every_case_validates_split_equal_to_colocated(routers: dict[str, ServedRouter],
                                                             sampling: str) -> None:
    results: dict[str, list[tuple[str, str]]] = {}
    for name, router in routers.items():
        async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                      timeout=600) as client:
            results[name] = list(await asyncio.gather(*(
                _ask(client, case, None if sampling == "greedy" else 7000 + i)
                for i, case in enumerate(CASES))))
    for case, (text, finish), (split_text, _) in zip(CASES, results["colocated"], results["split"],
                                                      strict=True):
        case.check(text)
        assert finish == "stop", (case.name, text)
        assert split_text == text, (case.name, text, split_text)
