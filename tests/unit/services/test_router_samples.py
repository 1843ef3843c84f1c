"""The router's samples over a scripted dispatcher (no workers): their text is the tokenizer's own
decode of their token ids for both skip_special_tokens and spaces_between_special_tokens, in
whatever steps they stream; the token that stopped a sample stays out of its text, as in vLLM;
best_of keeps the samples with the highest cumulative logprob; a batch numbers choices k * n + i."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import replace
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from services.router.config import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions, Step
from services.router.fanout import Delta, RunOptions, cumulative_logprob, keep_best, plan
from services.router.generation import Generator
from services.router.metrics import RouterMetrics
from services.worker.client import Logprob

TEXT = "Hello <|im_start|>user\nthere<file_sep>x <|endoftext|> y<|im_end|>"


class ScriptedDispatcher:
    """`generate` streams each sample's token ids `chunk` at a time, ending with `finish`."""

    def __init__(self, token_ids: list[int], chunk: int, finish: str = "length") -> None:
        self.token_ids, self.chunk, self.finish = token_ids, chunk, finish
        self.calls: list[tuple[str, list[int], SamplingParams]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str = "") -> AsyncGenerator[Step, None]:
        self.calls.append((request_id, prompt_ids, params))
        ids = self.token_ids
        for i in range(0, len(ids), self.chunk):
            last = i + self.chunk >= len(ids)
            yield Step(ids[i:i + self.chunk], finish_reason=self.finish if last else "")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.config import DEFAULT_MODEL
    from engine.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture
def generator(tokenizer: Any) -> Iterator[Generator]:
    config = RouterConfig(model="m", tokenizer="unused", max_model_len=256,
                          dispatch=DispatchOptions(decode=("127.0.0.1:1",)))
    gen = Generator(config, tokenizer, ScriptedDispatcher([], 1), RouterMetrics("m"))  # type: ignore[arg-type]
    yield gen
    gen.close()


async def _texts(gen: Generator, prompts: list[list[int]], opts: RunOptions) -> dict[int, str]:
    texts: dict[int, str] = {}
    async for delta in gen.run("r", prompts, opts):
        texts[delta.index] = texts.get(delta.index, "") + delta.text
    return texts


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("spaces", [True, False], ids=["spaces", "no-spaces"])
async def test_sample_text_is_the_tokenizers_decode_for_both_special_token_settings(
        generator: Generator, tokenizer: Any, chunk: int, skip: bool, spaces: bool) -> None:
    ids = tokenizer(TEXT).input_ids
    assert set(ids) & set(tokenizer.all_special_ids) and 5 in ids  # <file_sep>: an added special token
    generator.dispatcher = ScriptedDispatcher(ids, chunk)  # type: ignore[assignment]
    opts = RunOptions(SamplingParams(max_tokens=64), skip_special_tokens=skip,
                      spaces_between_special_tokens=spaces)
    text = (await _texts(generator, [[1, 2, 3]], opts))[0]
    assert text == tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert ("<|im_start|>" in text) is not skip


@pytest.mark.asyncio
@pytest.mark.parametrize("include_stop", [False, True])
async def test_the_stop_token_is_left_out_of_the_text_unless_stop_strings_are_kept(
        generator: Generator, tokenizer: Any, include_stop: bool) -> None:
    ids = [*tokenizer("The end").input_ids, tokenizer.eos_token_id]  # the worker stopped on EOS
    generator.dispatcher = ScriptedDispatcher(ids, 1, finish="stop")  # type: ignore[assignment]
    opts = RunOptions(SamplingParams(max_tokens=64), include_stop=include_stop, skip_special_tokens=False)
    text = (await _texts(generator, [[1]], opts))[0]
    assert text == tokenizer.decode(ids if include_stop else ids[:-1], skip_special_tokens=False)


@pytest.mark.asyncio
@pytest.mark.parametrize("include_stop", [False, True])
async def test_a_stop_string_inside_a_multi_token_step_ends_the_sample_at_its_token(
        generator: Generator, tokenizer: Any, include_stop: bool) -> None:
    """A step may carry several tokens (a decode worker's chunk while the router was busy): the
    tokens after the one completing a stop string are not reported (ids, logprobs, usage), so
    the sample is the same whatever the chunking, as vLLM's per-token stop check gives."""
    ids = tokenizer("one two three four five six").input_ids
    got = {}
    for chunk in (1, 4, len(ids)):
        generator.dispatcher = ScriptedDispatcher(ids, chunk)  # type: ignore[assignment]
        opts = RunOptions(SamplingParams(max_tokens=64), stops=("three",), include_stop=include_stop)
        text, tokens, usage = "", [], 0
        async for delta in generator.run("r", [[1]], opts):
            text, tokens, usage = text + delta.text, tokens + list(delta.token_ids), delta.completion_tokens
        got[chunk] = (text, tokens, usage)
    text, tokens, usage = got[1]
    assert text == ("one two three" if include_stop else "one two ")
    assert tokenizer.decode(tokens).endswith("three") and usage == len(tokens) < len(ids)
    assert got[4] == got[len(ids)] == got[1]


@pytest.mark.asyncio
async def test_a_batch_runs_n_samples_per_prompt_numbered_as_vllm(generator: Generator) -> None:
    generator.dispatcher = ScriptedDispatcher([42], 1)  # type: ignore[assignment]
    opts = RunOptions(SamplingParams(max_tokens=4, seed=7), n=2)
    texts = await _texts(generator, [[1], [2, 2], [3, 3, 3]], opts)
    assert sorted(texts) == [0, 1, 2, 3, 4, 5]
    calls = sorted(generator.dispatcher.calls)  # type: ignore[attr-defined]
    assert [(rid, prompt, p.seed) for rid, prompt, p in calls] == [
        ("0_r-0", [1], 7), ("0_r-1", [2, 2], 7), ("0_r-2", [3, 3, 3], 7),
        ("1_r-0", [1], 8), ("1_r-1", [2, 2], 8), ("1_r-2", [3, 3, 3], 8)]
    assert [s.request_id for s in plan("r", 1, RunOptions(SamplingParams()))] == ["r"]


def _delta(index: int, logprobs: list[float], finish: str | None = None) -> Delta:
    positions = [[Logprob(100 + k, lp, 1), Logprob(7, -0.01, 1)] for k, lp in enumerate(logprobs)]
    return Delta(index, f"s{index}", [100 + k for k in range(len(logprobs))], positions, finish,
                 len(logprobs), 0)


def test_best_of_keeps_the_n_samples_with_the_highest_cumulative_logprob_best_first() -> None:
    # Two prompts, best_of=3, n=2: samples 0..2 of prompt 0, 3..5 of prompt 1, in two deltas each.
    sums = {0: -3.0, 1: -1.0, 2: -2.0, 3: -0.5, 4: -0.5, 5: -9.0}
    deltas = [d for i, total in sums.items()
              for d in (_delta(i, [total / 2]), _delta(i, [total / 2], "length"))]
    asked = RunOptions(SamplingParams(logprobs=1), n=2, best_of=3)
    kept = keep_best(deltas, asked, num_prompts=2)
    # Prompt 0: samples 1 (-1) then 2 (-2); prompt 1: 3 and 4 tie at -0.5 (the lower first).
    assert [(d.index, d.text) for d in kept] == [(0, "s1"), (0, "s1"), (1, "s2"), (1, "s2"),
                                                 (2, "s3"), (2, "s3"), (3, "s4"), (3, "s4")]
    assert cumulative_logprob([d for d in kept if d.index == 0]) == -1.0
    assert all(d.logprobs for d in kept)
    unasked = replace(asked, params=SamplingParams())
    assert unasked.sample_params.logprobs == 0  # the workers are asked anyway
    assert all(not d.logprobs for d in keep_best(deltas, unasked, num_prompts=2))
