"""Speculative decoding on the decode worker of a split (real gRPC, real KV store): the tokens
and logprobs equal a colocated worker's without speculation, greedy and seeded, and the decode
worker's /metrics carry vLLM's speculative-decoding counters. The decode worker builds no draft
state from the hand-off: n-gram drafts come from the prompt and outputs it already holds."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.sampling_params import SamplingParams
from kvstore.service import KVStoreService
from services.procs import free_port
from services.router.dispatch.dispatcher import Dispatcher, DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.conftest import running_together, worker_options
from tests.integration.services.split.test_split_sampling import _ready, _sample

in_module_loop = pytest.mark.asyncio(loop_scope="module")
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# a phrase, then most of it again: its continuation is likely drafted from the first time
PHRASE = [5, 17, 99, 3, 250, 41, 7, 88, 123, 19, 64, 2, 77, 301, 45, 9]
PROMPT = PHRASE + PHRASE[:10]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dispatchers(model_dir: Path, store: KVStoreService) -> AsyncIterator[dict[str, Any]]:
    decode = worker_options(model_dir, store, "decode", metrics_port=free_port())
    decode = replace(decode, engine=replace(decode.engine, speculative_config=SPEC))
    servers = {"prefill": WorkerServer(worker_options(model_dir, store, "prefill")),
               "decode": WorkerServer(decode),
               "colocated": WorkerServer(worker_options(model_dir, store, "colocated"))}
    async with running_together(servers):
        made = {"split": Dispatcher(DispatchOptions(prefill=(servers["prefill"].target,),
                                                    decode=(servers["decode"].target,))),
                "colocated": Dispatcher(DispatchOptions(decode=(servers["colocated"].target,)))}
        for d in made.values():
            await _ready(d)
        try:
            yield {**made, "decode_server": servers["decode"]}
        finally:
            for d in made.values():
                await d.close()


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


CASES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_k": 2, "seed": 3},
    "penalized": {"temperature": 0.0, "frequency_penalty": 0.4, "min_tokens": 5},
}


@in_module_loop
@pytest.mark.parametrize("case", list(CASES))
async def test_split_with_speculation_equals_colocated_without(dispatchers: dict[str, Any],
                                                               case: str) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2, **CASES[case])
    split, colocated = await asyncio.gather(
        _sample(dispatchers["split"], f"split-{case}", params, PROMPT),
        _sample(dispatchers["colocated"], f"colo-{case}", params, PROMPT))
    assert split[0] == colocated[0] and split[2] == colocated[2]
    for a, b in zip(split[1], colocated[1], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


@in_module_loop
async def test_the_decode_workers_metrics_count_drafts_and_accepted_tokens(
        dispatchers: dict[str, Any]) -> None:
    await _sample(dispatchers["split"], "metrics", SamplingParams(temperature=0.0, max_tokens=40,
                                                                  ignore_eos=True), PROMPT)
    port = dispatchers["decode_server"].metrics_port

    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()

    text = await asyncio.to_thread(fetch)
    drafts = _counter(text, "vllm:spec_decode_num_drafts_total")
    drafted = _counter(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = _counter(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
    assert per_pos == accepted  # each accepted token counted at its one position
    assert 'position="3"' in text  # every position up to num_speculative_tokens is exported
