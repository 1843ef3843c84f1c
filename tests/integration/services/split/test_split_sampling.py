"""Disaggregation never changes a sampled token: the same requests through a prefill + decode
pair (real gRPC, real KV store) and through a colocated worker give identical token ids and
logprobs, for every sampling parameter, seeded (issue 18). A seeded draw depends on (seed,
output position) only, and the decode worker is told which of its input tokens are outputs.

The prefill retry (the prompt computed on a second prefill worker, or by the decode worker
after every prefill failed) gives the same tokens too; the decode migration is covered in
test_migration.py with seeded, penalized samples.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from engine.sampling_params import SamplingParams
from services.router.dispatch.dispatcher import Dispatcher, DispatchOptions
from services.router.dispatch.pool import Pick
from services.worker.server import WorkerOptions, WorkerServer
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 88, 123, 19, 64, 2, 77, 301, 45, 9, 150, 33, 12]  # > one block
NEW = 24
BASE: dict[str, Any] = {"max_tokens": NEW, "ignore_eos": True, "logprobs": 3}

CASES: dict[str, dict[str, Any]] = {
    "t0.7-seed": {"temperature": 0.7, "seed": 1},
    "t1.0-seed": {"temperature": 1.0, "seed": 2},
    "t1.5-seed": {"temperature": 1.5, "seed": 3},
    "top-k": {"temperature": 1.0, "seed": 4, "top_k": 5},
    "top-p": {"temperature": 1.0, "seed": 5, "top_p": 0.8},
    "min-p": {"temperature": 1.0, "seed": 6, "min_p": 0.05},
    "presence": {"temperature": 1.0, "seed": 7, "presence_penalty": 1.5},
    "frequency": {"temperature": 1.0, "seed": 8, "frequency_penalty": 1.5},
    "repetition": {"temperature": 1.0, "seed": 9, "repetition_penalty": 1.8},
    "greedy-penalties": {"temperature": 0.0, "presence_penalty": 2.0, "frequency_penalty": 1.0,
                         "repetition_penalty": 1.5},
    "logit-bias": {"temperature": 1.0, "seed": 10, "logit_bias": {7: 14.0, 9: 13.0, 11: -100.0}},
    "bad-words": {"temperature": 0.0, "bad_words_token_ids": [[1], [2], [7, 9], [3]]},
    "allowed": {"temperature": 1.0, "seed": 11, "allowed_token_ids": [4, 8, 15, 16, 23, 42]},
    "min-tokens": {"temperature": 1.0, "seed": 12, "min_tokens": 10, "ignore_eos": False,
                   "stop_token_ids": [4, 5, 6, 7, 8, 9, 10, 11]},
    "everything": {"temperature": 0.9, "seed": 13, "top_k": 20, "top_p": 0.9, "min_p": 0.01,
                   "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                   "logit_bias": {7: 3.0}, "bad_words_token_ids": [[9, 9]], "min_tokens": 3},
}


FAILED: list[str] = []
DECISIONS: list[str] = []


async def _ready(d: Dispatcher) -> Dispatcher:
    d.start()
    deadline = time.monotonic() + 30
    while not all(pool.healthy for pool in d.pools):
        assert time.monotonic() < deadline, "workers never reported serving"
        await asyncio.sleep(0.05)
    return d


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dispatchers(workers: dict[str, WorkerServer]) -> AsyncIterator[dict[str, Dispatcher]]:
    made = {
        "split": Dispatcher(DispatchOptions(prefill=(workers["prefill"].target,),
                                            decode=(workers["decode"].target,))),
        "colocated": Dispatcher(DispatchOptions(decode=(workers["colocated"].target,))),
        # The first prefill target (picked first, below) is a colocated worker, whose Prefill
        # fails (UNIMPLEMENTED): the prompt goes to the second.
        "retried": Dispatcher(DispatchOptions(prefill=(workers["colocated"].target,
                                                       workers["prefill"].target),
                                              decode=(workers["decode"].target,)),
                              on_prefill_failure=FAILED.append, on_decision=DECISIONS.append),
        # every prefill fails: the decode worker computes the prompt itself
        "fallback": Dispatcher(DispatchOptions(prefill=(workers["colocated"].target,),
                                               decode=(workers["decode"].target,)),
                               on_prefill_failure=FAILED.append, on_decision=DECISIONS.append),
    }
    pool = made["retried"].prefill
    assert pool is not None
    pick = pool.pick

    def colocated_first(hashes: Any = (), exclude: frozenset[str] = frozenset(),
                        prompt_tokens: int = 0) -> Pick | None:
        if not exclude:
            return Pick(pool.workers[0], 0)
        return pick(hashes, exclude, prompt_tokens)

    pool.pick = colocated_first  # type: ignore[method-assign]
    try:
        for d in made.values():
            await _ready(d)
        yield made
    finally:
        for d in made.values():
            await d.close()


async def _sample(d: Dispatcher, rid: str, params: SamplingParams, prompt: list[int] = PROMPT
                  ) -> tuple[list[int], list[list[tuple[int, float]]], str]:
    ids: list[int] = []
    lps: list[list[tuple[int, float]]] = []
    finish = ""
    async for step in d.generate(rid, prompt, params):
        ids += step.token_ids
        lps += [[(c.token_id, c.logprob) for c in pos] for pos in step.logprobs]
        finish = step.finish_reason or finish
    return ids, lps, finish


def _same(a: tuple[list[int], list[list[tuple[int, float]]], str],
          b: tuple[list[int], list[list[tuple[int, float]]], str]) -> None:
    assert a[0] == b[0] and a[2] == b[2]
    assert [[t for t, _ in pos] for pos in a[1]] == [[t for t, _ in pos] for pos in b[1]]
    for pa, pb in zip(a[1], b[1], strict=True):
        assert [lp for _, lp in pa] == pytest.approx([lp for _, lp in pb], abs=1e-5)


@in_module_loop
@pytest.mark.parametrize("case", list(CASES))
async def test_split_equals_colocated(dispatchers: dict[str, Dispatcher], case: str) -> None:
    params = SamplingParams(**{**BASE, **CASES[case]})
    split, colocated = await asyncio.gather(_sample(dispatchers["split"], f"split-{case}", params),
                                            _sample(dispatchers["colocated"], f"colo-{case}", params))
    _same(split, colocated)
    assert len(split[0]) == NEW or (split[2] == "stop" and len(split[0]) >= params.min_tokens)
    if params.allowed_token_ids:
        assert set(split[0]) <= set(params.allowed_token_ids)
    if params.bad_words_token_ids:
        singles = {w[0] for w in params.bad_words_token_ids if len(w) == 1}
        assert not singles & set(split[0])
        pairs = [w for w in params.bad_words_token_ids if len(w) == 2]
        assert not any(split[0][i:i + 2] == w for w in pairs for i in range(len(split[0])))
    if case == "logit-bias":
        assert 11 not in split[0] and split[0].count(7) + split[0].count(9) > NEW // 2


@in_module_loop
async def test_n_samples_with_a_seed_are_the_same_split_and_colocated(
        dispatchers: dict[str, Dispatcher]) -> None:
    params = SamplingParams(temperature=1.0, seed=21, presence_penalty=0.5, **BASE)
    runs = {name: asyncio.gather(*(_sample(dispatchers[name], f"{name}-n{i}", params.for_child(i))
                                   for i in range(3)))
            for name in ("split", "colocated")}
    outs = dict(zip(runs, await asyncio.gather(*runs.values()), strict=True))
    for a, b in zip(outs["split"], outs["colocated"], strict=True):
        _same(a, b)
    assert len({tuple(o[0]) for o in outs["split"]}) == 3  # the samples differ from each other


@in_module_loop
async def test_seeded_tokens_do_not_depend_on_the_batch(dispatchers: dict[str, Dispatcher]) -> None:
    params = SamplingParams(temperature=1.0, seed=31, frequency_penalty=0.7, **BASE)
    alone = await _sample(dispatchers["split"], "alone", params)
    noise = [SamplingParams(temperature=1.2, max_tokens=NEW + 8, ignore_eos=True, seed=s)
             for s in range(4)]
    together = await asyncio.gather(
        _sample(dispatchers["split"], "in-batch", params),
        *(_sample(dispatchers["split"], f"noise-{i}", p, PROMPT[i:] + PROMPT[:i])
          for i, p in enumerate(noise)))
    _same(alone, together[0])


@in_module_loop
@pytest.mark.parametrize("route", ["retried", "fallback"])
async def test_a_retried_prefill_gives_the_same_tokens(dispatchers: dict[str, Dispatcher],
                                                       route: str) -> None:
    params = SamplingParams(**{**BASE, **CASES["everything"]})
    prompt = PROMPT[3:] + PROMPT[:3] if route == "retried" else PROMPT[5:] + PROMPT[:5]  # new prompts
    expected = await _sample(dispatchers["colocated"], f"colo-{route}", params, prompt)
    FAILED.clear()
    DECISIONS.clear()
    got = await _sample(dispatchers[route], f"{route}-1", params, prompt)
    _same(got, expected)
    assert [dispatchers["colocated"].decode.workers[0].target] == FAILED
    assert ["disaggregated" if route == "retried" else "fallback"] == DECISIONS


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_kept_in_the_output_are_the_same_split_and_colocated(
        routers: tuple[ServedRouter, ServedRouter], stream: bool) -> None:
    texts: list[tuple[str, str | None, list[float]]] = []
    for router in routers:
        async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                      timeout=60) as client:
            kw: dict[str, Any] = {"model": "tiny", "prompt": "The story of the", "max_tokens": 40,
                                  "temperature": 1.0, "seed": 5, "logprobs": 1, "stop": ["e", "a"],
                                  "extra_body": {"include_stop_str_in_output": True,
                                                 "ignore_eos": True}}
            if stream:
                text, finish, lps = "", None, []
                async for chunk in await client.completions.create(stream=True, **kw):
                    c = chunk.choices[0]
                    text += c.text
                    finish = c.finish_reason or finish
                    lps += list(c.logprobs.token_logprobs) if c.logprobs else []
                texts.append((text, finish, lps))
            else:
                out = (await client.completions.create(**kw)).choices[0]
                assert out.logprobs is not None
                texts.append((out.text, out.finish_reason, list(out.logprobs.token_logprobs)))
    (a_text, a_finish, a_lps), (b_text, b_finish, b_lps) = texts
    assert a_text == b_text and a_finish == b_finish == "stop"
    assert a_text.endswith(("e", "a"))
    assert a_lps == pytest.approx(b_lps, abs=1e-5)


@in_module_loop
async def test_prompt_logprobs_are_the_same_split_and_colocated(dispatchers: dict[str, Dispatcher]) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    got: dict[str, list[list[tuple[int, float]]]] = {}
    for name in ("split", "colocated", "fallback"):
        positions: list[list[tuple[int, float]]] = []
        async for step in dispatchers[name].generate(f"plp-{name}", PROMPT, params):
            positions += [[(c.token_id, c.logprob) for c in pos] for pos in step.prompt_logprobs]
        got[name] = positions
    assert len(got["split"]) == len(PROMPT) - 1
    assert [pos[0][0] for pos in got["split"]] == PROMPT[1:]  # the prompt token first
    for name in ("colocated", "fallback"):
        assert [[t for t, _ in p] for p in got[name]] == [[t for t, _ in p] for p in got["split"]]
        for a, b in zip(got[name], got["split"], strict=True):
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)


@in_module_loop
async def test_a_preemption_mid_decode_changes_no_token(workers: dict[str, WorkerServer], model_dir: Any,
                                                        store: Any, dispatchers: dict[str, Dispatcher]
                                                        ) -> None:
    """A decode worker with room for about three of these samples at once preempts one of four
    mid-decode; its tokens are still the colocated worker's."""
    from dataclasses import replace

    from services.procs import free_port
    from tests.integration.services.conftest import engine_config

    config = replace(engine_config(model_dir, store.location), max_model_len=256, num_kv_blocks=20)
    small = WorkerServer(WorkerOptions(role="decode", engine=config, grace_s=5.0, port=free_port()))
    await small.start()
    split = await _ready(Dispatcher(DispatchOptions(prefill=(workers["prefill"].target,),
                                                    decode=(small.target,))))
    try:
        params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=100, ignore_eos=True, logprobs=1,
                                 presence_penalty=0.5, repetition_penalty=1.2) for i in range(4)]
        prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
        got = await asyncio.gather(*(_sample(split, f"pre-{i}", p, q)
                                     for i, (p, q) in enumerate(zip(params, prompts, strict=True))))
        engine = small.servicer.engine
        assert engine is not None and (await engine.get_stats()).num_preemptions > 0, "no preemption"
        for i, (p, q) in enumerate(zip(params, prompts, strict=True)):
            _same(got[i], await _sample(dispatchers["colocated"], f"pre-colo-{i}", p, q))
    finally:
        await split.close()
        await small.stop(grace_s=1.0)


@in_module_loop
async def test_a_first_token_that_ends_the_sample_leaves_no_early_decode_behind(
        dispatchers: dict[str, Dispatcher], workers: dict[str, WorkerServer]) -> None:
    """The early decode call went out with the prefill; the prefill's token is a stop token, so
    the sample ends there: the call is cancelled (the decode worker frees its blocks) and its
    lease in the decode pool released."""
    from services.worker.client import WorkerClient

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = (await _sample(dispatchers["colocated"], "colo-stop-first", greedy))[0][0]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first])
    ids, _, finish = await _sample(dispatchers["split"], "split-stop-first", params)
    assert (ids, finish) == ([first], "stop")
    pool = dispatchers["split"].decode
    async with WorkerClient(workers["decode"].target) as client:
        deadline = time.monotonic() + 10
        while True:
            load = await client.load()
            if (load.num_running, load.num_waiting, load.num_free_blocks) == \
                    (0, 0, load.num_total_blocks) and all(w.inflight == 0 for w in pool.workers):
                break
            assert time.monotonic() < deadline, (load, [w.inflight for w in pool.workers])
            await asyncio.sleep(0.05)
