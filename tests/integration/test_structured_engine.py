"""Structured outputs in the engine (tiny random Llama, float32): a request waits for its grammar
while others run; a grammar the engine cannot compile ends only its request; constrained and
unconstrained requests share batches without changing each other; preemption, n > 1, every
sampling parameter, a continued sample and the engine-core process keep outputs valid and equal
to their references; a grammar that ends stops the request; no KV block is left behind."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.core.outputs import EngineCoreRequest
from engine.core.request import RequestStatus
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.backends import XgrammarBackend
from engine.structured.params import StructuredOutputsParams as SOP

EOS = 2
MAX_STEPS = 2000  # bound on every stepping loop
# Tiny random models write whitespace forever when JSON allows it: no free whitespace, bounded
# strings and numbers, so each output ends well within max_tokens.
SCHEMA = {"type": "object",
          "properties": {"zeta": {"enum": ["x", "y", "z"]},
                         "alpha": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 4}},
          "required": ["zeta", "alpha", "ok", "tag"], "additionalProperties": False}
SPECS = {
    "json": SOP(json=SCHEMA, disable_any_whitespace=True),
    "regex": SOP(regex=r"[a-c]{2,6}-\d{1,3}"),
    "choice": SOP(choice=["red", "green", "blue"]),
    "grammar": SOP(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] | [0-9]'),
}
GRAMMAR_RE = r"\([a-z0-9](,[a-z0-9]){0,3}\)"  # SPECS["grammar"] as a regex


def valid(params: SOP, text: str) -> bool:
    """`text` satisfies the constraint (checked independently of the engine's backends)."""
    if params.json is not None:
        try:
            jsonschema.validate(json.loads(text), json.loads(params.json),
                                format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if params.regex is not None:
        return re.fullmatch(params.regex, text) is not None
    if params.choice is not None:
        return text in params.choice
    return re.fullmatch(GRAMMAR_RE, text) is not None


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def constrained(spec: SOP, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **kw}, structured_outputs=spec)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> Iterator[LLM]:
    engine = LLM(model=str(tiny_model_dir("llama")), num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def no_blocks_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test every KV block of the module's engine is free again."""
    yield
    if "llm" in request.fixturenames:
        stats = request.getfixturevalue("llm").get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks


@dataclass
class Finished:
    token_ids: list[int]
    finish_reason: str
    stop_reason: Any


def step_until_done(core: EngineCore, ids: set[str],
                    until: Callable[[dict[str, Finished]], bool] | None = None) -> dict[str, Finished]:
    """Steps the core until the requests `ids` finished (or `until(finished)` holds)."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, Finished] = {}
    for _ in range(MAX_STEPS):
        if (until(done) if until is not None else set(done) == ids):
            return done
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = Finished(tokens[out.request_id], str(out.finish_reason),
                                                out.stop_reason)
    raise AssertionError(f"not done after {MAX_STEPS} steps: {sorted(ids - set(done))}")


def core_request(llm: LLM, req_id: str, prompt: list[int], params: SamplingParams,
                 num_prior_outputs: int = 0) -> EngineCoreRequest:
    (req,) = llm.processor.make_requests(req_id, prompt, params,
                                         num_prior_outputs=num_prior_outputs)
    return req


def text_of(llm: LLM, token_ids: list[int]) -> str:
    return str(llm.tokenizer.decode(token_ids, skip_special_tokens=True))


class HeldCompile:
    """XgrammarBackend.compile, patched: specs containing `marker` wait for `release` (or raise,
    with `fail`); every other spec compiles as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, marker: str, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = XgrammarBackend.compile

        def compile(backend: XgrammarBackend, params: SOP) -> Any:
            if marker in params.spec:
                self.entered.set()
                if fail:
                    raise RuntimeError("the compiler ran out of memory")
                assert self.release.wait(60)
            return real(backend, params)

        monkeypatch.setattr(XgrammarBackend, "compile", compile)


def test_a_request_waits_for_its_grammar_while_others_run(llm: LLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldCompile(monkeypatch, marker="slowgrammar")
    core = llm.engine_core
    p = prompts(2)
    spec = SOP(regex=r"slowgrammar[0-9]")
    core.add_request(core_request(llm, "slow", p[0], constrained(spec)))
    core.add_request(core_request(llm, "free", p[1], SamplingParams(temperature=0, max_tokens=8)))
    assert held.entered.wait(60)
    done = step_until_done(core, {"slow", "free"}, until=lambda d: "free" in d)
    assert done["free"].finish_reason == "length" and len(done["free"].token_ids) == 8
    slow = core.scheduler.requests["slow"]
    assert slow.status == RequestStatus.WAITING_FOR_FSM and slow.num_computed_tokens == 0
    assert "slow" not in done and core.has_unfinished_requests()
    stats = core.get_stats()
    assert (stats.num_waiting, stats.num_running) == (1, 0)  # a router sees it queued
    held.release.set()
    done = step_until_done(core, {"slow"})
    assert done["slow"].finish_reason == "stop" and done["slow"].token_ids[-1] == EOS
    assert valid(spec, text_of(llm, done["slow"].token_ids))


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldCompile(monkeypatch, marker="abortedgrammar")
    core = llm.engine_core
    core.add_request(core_request(llm, "gone", prompts(1)[0],
                                  constrained(SOP(regex="abortedgrammar"))))
    assert held.entered.wait(60)
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests() and "gone" not in core.scheduler.requests
    assert core.step().outputs == [] and core.get_stats().num_waiting == 0
    held.release.set()


def test_a_grammar_the_engine_cannot_compile_fails_only_its_request(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldCompile(monkeypatch, marker="explodes", fail=True)
    core = llm.engine_core
    p = prompts(3, seed=5)
    bad = SOP(regex=r"explodes[0-9]")
    core.add_request(core_request(llm, "bad", p[0], constrained(bad)))
    core.add_request(core_request(llm, "ok-free", p[1], SamplingParams(temperature=0, max_tokens=6)))
    core.add_request(core_request(llm, "ok-json", p[2], constrained(SPECS["json"])))
    done = step_until_done(core, {"bad", "ok-free", "ok-json"})
    assert held.entered.is_set()
    assert done["bad"].finish_reason == "abort" and done["bad"].token_ids == []
    assert str(done["bad"].stop_reason).startswith(
        "structured outputs: the grammar failed to compile: the compiler ran out of memory")
    assert done["ok-free"].finish_reason == "length"
    assert done["ok-json"].finish_reason == "stop"
    assert valid(SPECS["json"], text_of(llm, done["ok-json"].token_ids))
    # the front end reports it as an ended request, and the engine serves on
    out = llm.generate([p[0], p[1]], [constrained(bad), constrained(SPECS["regex"])],
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "abort"
    assert valid(SPECS["regex"], out[1].outputs[0].text)


def test_constrained_and_free_requests_in_one_batch_leave_each_other_alone(llm: LLM) -> None:
    p = prompts(8, seed=11)
    free = [SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=1.0, seed=7, max_tokens=24)] * 2
    alone = llm.generate(p[:4], free, use_tqdm=False)
    specs = list(SPECS.values())
    mixed = llm.generate(p, free + [constrained(s) for s in specs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for spec, out in zip(specs, mixed[4:], strict=True):
        assert out.outputs[0].finish_reason == "stop", (spec.kind, out.outputs[0].text)
        assert valid(spec, out.outputs[0].text), (spec.kind, out.outputs[0].text)
        assert out.outputs[0].token_ids[-1] == EOS


def test_every_way_of_filling_and_applying_gives_the_same_tokens(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the step fills the bitmask itself (with the additive mask it adds to the logits);
    filled in the fill thread beside the forward (the GPU's way), applied from the bitmask
    (the kernel path), or with greedy rows masked only when needed (CPU's default), the tokens
    are the same, greedy and seeded."""
    core = llm.engine_core
    assert core.check_unmasked
    monkeypatch.setattr(core, "check_unmasked", False)  # every row filled first
    manager = core.structured
    threads: set[str] = set()
    fill = manager._fill

    def recording(matchers: list[Any], additive: bool) -> Any:
        threads.add(threading.current_thread().name)
        return fill(matchers, additive)

    monkeypatch.setattr(manager, "_fill", recording)
    p = prompts(4, seed=23)
    params = [constrained(s, temperature=t, seed=5) for s in SPECS.values() for t in (0.0, 1.0)]
    p = [p[i % 4] for i in range(len(params))]

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)]

    assert not core.fill_in_thread
    on_cpu = tokens()
    assert threads == {threading.current_thread().name}
    threads.clear()
    monkeypatch.setattr(core, "fill_in_thread", True)
    assert tokens() == on_cpu
    assert threads and all(t.startswith("grammar-fill") for t in threads)
    monkeypatch.setattr(manager, "_fill", lambda matchers, _additive: fill(matchers, False))
    assert tokens() == on_cpu
    monkeypatch.setattr(manager, "_fill", fill)
    monkeypatch.setattr(core, "fill_in_thread", False)
    monkeypatch.setattr(core, "check_unmasked", True)
    checked = manager.check_counts.checked
    assert tokens() == on_cpu
    assert manager.check_counts.checked > checked


@pytest.mark.parametrize("mode", ["here", "fill-thread", "argmax-check"])
def test_a_fill_that_fails_fails_the_step_and_the_next_step_runs(
        llm: LLM, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Filled before the forward, in the fill thread, or for a greedy row whose unmasked
    choice the grammar refused (inside the sampler)."""
    manager = llm.engine_core.structured
    monkeypatch.setattr(llm.engine_core, "fill_in_thread", mode == "fill-thread")
    monkeypatch.setattr(llm.engine_core, "check_unmasked", mode == "argmax-check")
    refused = manager.check_counts.refused
    fill = manager._fill

    def broken(matchers: list[Any], additive: bool) -> Any:
        raise RuntimeError("fill broke")

    monkeypatch.setattr(manager, "_fill", broken)
    with pytest.raises(RuntimeError, match="fill broke"):
        llm.generate(prompts(1, seed=3), [constrained(SPECS["regex"])], use_tqdm=False)
    assert (manager.check_counts.refused > refused) == (mode == "argmax-check")
    monkeypatch.setattr(manager, "_fill", fill)
    core = llm.engine_core
    core.abort_requests(list(core.scheduler.requests))
    out = llm.generate(prompts(1, seed=3), [constrained(SPECS["regex"])], use_tqdm=False)
    assert valid(SPECS["regex"], out[0].outputs[0].text)


def test_a_grammar_that_ends_stops_the_request_even_under_ignore_eos(llm: LLM) -> None:
    (out,) = llm.generate(prompts(1), constrained(SPECS["choice"], ignore_eos=True,
                                                  max_tokens=30), use_tqdm=False)
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.text in SPECS["choice"].choice  # type: ignore[operator]
    assert sample.token_ids[-1] == EOS and len(sample.token_ids) < 30


def test_a_structural_tag_constrains_the_output(llm: LLM) -> None:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi there"}}
    (out,) = llm.generate(prompts(1, seed=41), constrained(SOP(structural_tag=json.dumps(tag))),
                          use_tqdm=False)
    assert out.outputs[0].text == "hi there" and out.outputs[0].finish_reason == "stop"


def test_min_tokens_past_the_grammars_end_fails_the_request_saying_why(llm: LLM) -> None:
    """The grammar allows only its stop token, min_tokens forbids it: nothing is left to
    sample. The request ends with an error that says so (not a wrong output)."""
    (out,) = llm.generate(prompts(1), constrained(SPECS["choice"], min_tokens=8), use_tqdm=False)
    sample = out.outputs[0]
    assert sample.finish_reason == "abort"
    assert "min_tokens=8 forbids the stop token" in str(sample.stop_reason)


def test_both_backends_give_the_same_tokens(llm: LLM) -> None:
    """The same spec under xgrammar and llguidance: the same greedy tokens, ending the same way
    (llguidance's matcher stops before the eos; the engine's matcher still ends on it)."""
    p = prompts(3, seed=13)
    specs = [SPECS["regex"], SPECS["choice"], SPECS["grammar"]]
    outs = {}
    for backend in ("xgrammar", "guidance"):
        params = [constrained(replace(s, backend=backend)) for s in specs]
        outs[backend] = [o.outputs[0] for o in llm.generate(p, params, use_tqdm=False)]
    assert [o.token_ids for o in outs["xgrammar"]] == [o.token_ids for o in outs["guidance"]]
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == EOS for o in outs["guidance"])


def test_two_seeded_samples_of_one_constrained_request_are_valid_and_distinct(llm: LLM) -> None:
    spec = SOP(regex=r"[a-z]{6,10}")
    params = constrained(spec, n=2, temperature=1.0, seed=42)
    (out,) = llm.generate(prompts(1, seed=17), params, use_tqdm=False)
    texts = [s.text for s in out.outputs]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert all(valid(spec, t) for t in texts)
    (again,) = llm.generate(prompts(1, seed=17), params, use_tqdm=False)
    assert [s.text for s in again.outputs] == texts  # seeded: reproducible


def test_every_sampling_parameter_under_a_grammar_gives_valid_output(llm: LLM) -> None:
    tok = llm.tokenizer
    letters = [tok.convert_tokens_to_ids(c) for c in "abcdxyz"]
    sampled: list[SamplingParams] = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.0, seed=2, top_k=3),
        SamplingParams(temperature=1.0, seed=3, top_p=0.5),
        SamplingParams(temperature=1.0, seed=4, min_p=0.2),
        SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5, frequency_penalty=1.0,
                       repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=6, logit_bias={letters[0]: 100.0, EOS: -100.0}),
        SamplingParams(temperature=1.0, seed=7, allowed_token_ids=[*letters, EOS, 11, 500]),
        SamplingParams(temperature=1.0, seed=8, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0, min_tokens=2),
    ]
    spec = SOP(regex=r"[a-d]{1,8}")
    params = [replace(s, max_tokens=16, structured_outputs=spec) for s in sampled]
    # (allowed_token_ids of letters leave a JSON object nothing to start with)
    json_params = [replace(s, max_tokens=48, structured_outputs=SPECS["json"])
                   for s in sampled if s.allowed_token_ids is None]
    p = prompts(len(params), seed=19)
    outs = llm.generate(p + p[:len(json_params)], params + json_params, use_tqdm=False)
    for i, out in enumerate(outs):
        sample, want = out.outputs[0], (spec if i < len(params) else SPECS["json"])
        assert sample.finish_reason == "stop", (i, sample.text)
        assert valid(want, sample.text), (i, sample.text)
    biased = outs[6].outputs[0]
    assert biased.text == "aaaaaaaa"  # the bias is applied after the grammar: a, never eos early
    assert set(outs[7].outputs[0].text) <= set("abcd")
    for out in (outs[8], outs[9]):
        sample = out.outputs[0]
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
            assert token in entry and entry[token].logprob > float("-inf")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_continued_sample_equals_the_colocated_run(llm: LLM, temperature: float,
                                                     backend: str) -> None:
    """As a decode worker continues the prefill worker's first token: the matcher is advanced
    over it, and the rest equals the run that sampled everything here (also where that one
    token completes the grammar: only the stop token is left)."""
    core = llm.engine_core
    specs = [replace(s, backend=backend) for s in [*SPECS.values(), SOP(choice=["red"])]]
    p = prompts(len(specs), seed=23)
    params = [constrained(s, temperature=temperature, seed=99) for s in specs]
    whole = llm.generate(p, params, use_tqdm=False)
    first = llm.generate(p, [replace(s, max_tokens=1) for s in params], use_tqdm=False)
    for i, (prompt, sp) in enumerate(zip(p, params, strict=True)):
        head = list(first[i].outputs[0].token_ids)
        assert head == list(whole[i].outputs[0].token_ids[:1])
        core.add_request(core_request(llm, f"cont{i}", [*prompt, *head], sp,
                                      num_prior_outputs=1))
    done = step_until_done(core, {f"cont{i}" for i in range(len(p))})
    for i, out in enumerate(whole):
        rest = done[f"cont{i}"]
        assert [*first[i].outputs[0].token_ids, *rest.token_ids] == list(out.outputs[0].token_ids)
        assert rest.finish_reason == "stop"


def test_earlier_outputs_the_grammar_refuses_fail_the_request(llm: LLM) -> None:
    core = llm.engine_core
    prompt = prompts(1, seed=29)[0]
    wrong = llm.tokenizer.convert_tokens_to_ids("z")
    core.add_request(core_request(llm, "refused", [*prompt, wrong], constrained(SPECS["choice"]),
                                  num_prior_outputs=1))
    done = step_until_done(core, {"refused"})
    assert done["refused"].finish_reason == "abort"
    assert "earlier output tokens do not match the grammar" in str(done["refused"].stop_reason)


def test_preempted_and_chunked_constrained_requests_give_the_plain_runs_tokens(
        llm: LLM, tiny_model_dir: Callable[[str], Path]) -> None:
    rng = random.Random(31)
    p = [[rng.randrange(100, 49000) for _ in range(n)] for n in (60, 90, 100, 110, 120, 130)]
    spec = SOP(regex=r"[0-9]{40,60}")  # digits are single tokens: 40+ decode steps each
    params = [constrained(spec, max_tokens=64, temperature=t, seed=5) for t in (0.0, 1.0)] * 3
    expected = llm.generate(p, params, use_tqdm=False)
    small = LLM(model=str(tiny_model_dir("llama")), num_threads=1, num_kv_blocks=17,
                max_model_len=256, enable_prefix_caching=False, max_num_batched_tokens=32)
    try:
        got = small.generate(p, params, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in got) > 0, "no preemption was forced"
        stats = small.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        small.shutdown()
    for want, out in zip(expected, got, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert valid(spec, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_the_engine_core_process_carries_structured_outputs(
        llm: LLM, tiny_model_dir: Callable[[str], Path]) -> None:
    """AsyncLLM with the core in its own process (msgspec messages): the same tokens as here,
    the JSON written in the schema's key order."""
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig

    p = prompts(4, seed=37)
    specs = list(SPECS.values())
    params = [constrained(s, temperature=1.0, seed=3) for s in specs]
    expected = llm.generate(p, params, use_tqdm=False)

    async def run() -> list[list[int]]:
        engine = AsyncLLM(EngineConfig(model=str(tiny_model_dir("llama")), num_threads=1))
        try:
            async def one(i: int) -> list[int]:
                final = None
                async for out in engine.generate(p[i], params[i], request_id=f"mp{i}"):
                    final = out
                assert final is not None and final.outputs[0].finish_reason == "stop"
                return list(final.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(i) for i in range(len(p)))))
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    assert got == [list(o.outputs[0].token_ids) for o in expected]
    text = expected[0].outputs[0].text
    assert list(json.loads(text)) == ["zeta", "alpha", "ok", "tag"]
