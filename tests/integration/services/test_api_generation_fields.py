"""Generation fields of vLLM's API the router implements, through the official `openai` client
against the router over a colocated worker, each checked against an independent reference:

- a batch of prompts (texts or token-id lists): choice k * n + i is sample i of prompt k, the
  same text as prompt k sent alone with the same seed, streamed or not; usage sums the prompts;
- best_of: the n of best_of samples with the highest cumulative logprob, as the same seeded
  samples fetched one by one with their logprobs rank them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.router.app import RouterConfig
from services.router.dispatch import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
TEXTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
IDS = [[28, 5, 900], [1, 2, 3, 4, 5], [7000, 12]]


@pytest.fixture(scope="module")
def router(colocated_worker: WorkerServer, model_dir: Path) -> Iterator[ServedRouter]:
    dispatch = DispatchOptions(decode=(colocated_worker.target,), decode_timeout_s=60)
    with ServedRouter(RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512,
                                   dispatch=dispatch)) as served:
        yield served


async def _complete(client: openai.AsyncOpenAI, prompt: Any, stream: bool = False, **kw: Any
                    ) -> tuple[dict[int, str], Any]:
    """(text by choice index, usage) of a completion, streamed or not."""
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "extra_body": extra, **kw}
    if not stream:
        out = await client.completions.create(**args)
        return {c.index: c.text for c in out.choices}, out.usage
    texts: dict[int, str] = {}
    usage = None
    async for chunk in await client.completions.create(**args, stream=True,
                                                       stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts, usage


@in_module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["texts", "token-ids"])
async def test_a_batch_numbers_choices_by_prompt_and_sample_as_the_prompts_sent_alone(
        client: openai.AsyncOpenAI, prompts: list[Any], stream: bool) -> None:
    seeded = {"n": 2, "seed": 11, "temperature": 1.0}
    batch, usage = await _complete(client, prompts, stream, **seeded)
    assert sorted(batch) == list(range(2 * len(prompts)))
    prompt_tokens = completion_tokens = 0
    for k, prompt in enumerate(prompts):
        alone, alone_usage = await _complete(client, prompt, **seeded)
        assert [batch[2 * k], batch[2 * k + 1]] == [alone[0], alone[1]]
        prompt_tokens += alone_usage.prompt_tokens
        completion_tokens += alone_usage.completion_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert batch[0] != batch[1]  # seed and seed + 1


@in_module_loop
async def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(
        client: openai.AsyncOpenAI) -> None:
    seeded = {"seed": 5, "temperature": 1.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    every = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=4, logprobs=0, **seeded)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=2, best_of=4, **seeded)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage is not None and best.usage.completion_tokens == 2 * 6  # the choices', as vLLM
    with_logprobs = await client.completions.create(model=MODEL, prompt=TEXTS[0], n=2, best_of=4,
                                                    logprobs=1, **seeded)
    assert [c.text for c in with_logprobs.choices] == [c.text for c in ranked[:2]]
    for got, want in zip(with_logprobs.choices, ranked[:2], strict=True):  # other batches: float noise
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    for kw in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=2, **kw)
        assert e.value.param == "best_of"
