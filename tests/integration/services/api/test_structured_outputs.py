"""Structured outputs through the router with the official `openai` client, on the tiny random
Llama: each form OpenAI and vLLM write (response_format, structured_outputs, guided_*) gives
output that follows it (JSON that validates against its schema, a regex's full match, one of
the choices, a grammar's sentence) and ends with "stop"; a prefill + decode pair through the KV
store gives the colocated worker's tokens exactly (the prefill worker samples the first token
under the grammar, the decode worker's matcher continues after it), greedy and seeded, streamed
or not. Bad forms and specs are 400s naming the field before any worker is called; a worker
given an uncompilable spec over gRPC refuses it with INVALID_ARGUMENT and keeps serving."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from services.procs import free_port
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.client import WorkerClient, WorkerError
from services.worker.server import WorkerServer
from tests.integration.services.router_util import IN_LOOP_LOAD_TIMEOUT_S, ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
MODEL = "tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "A person, as JSON:"

# Bounded everywhere: a random model would otherwise ramble inside a string or an array.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}
REGEX = r"(cat|dog)-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | "yes" | "no"'
LARK = 'start: "<" word (" " word)? ">"\nword: /[xyz]{1,3}/'


def _person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def _object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def _full(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def _choice(text: str) -> None:
    assert text in CHOICES, text


# case -> (chat?, request fields, check of the output text, logit_bias). A random model given free
# JSON whitespace (xgrammar's default, as vLLM's) emits whitespace until max_tokens, and xgrammar
# lets JSON strings hold raw control characters (which JSON forbids): "calm" bans the tokens that
# are whitespace or control characters only; "terse" also favours '"' (short keys and strings),
# then '}', and bans nesting (json_object allows any keys, values and depth).
Case = tuple[bool, dict[str, Any], Callable[[str], None], str | None]
CASES: dict[str, Case] = {
    "response_format-json_schema": (True, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
        _person, "calm"),
    "response_format-json_object": (False, {"response_format": {"type": "json_object"}}, _object, "terse"),
    "structured_outputs-json": (False, {"structured_outputs": {
        "json": PERSON, "disable_any_whitespace": True}}, _person, "calm"),
    "structured_outputs-regex": (True, {"structured_outputs": {"regex": REGEX}}, _full(REGEX), None),
    "structured_outputs-choice": (False, {"structured_outputs": {"choice": CHOICES}}, _choice, None),
    "structured_outputs-ebnf": (True, {"structured_outputs": {"grammar": EBNF}},
                                _full(r"\((?:[a-c]|yes|no)(?:,(?:[a-c]|yes|no)){0,3}\)"), None),
    "guided_grammar-lark": (False, {"guided_grammar": LARK}, _full(r"<[xyz]{1,3}(?: [xyz]{1,3})?>"), None),
    "guided_json": (True, {"guided_json": json.dumps(PERSON)}, _person, "calm"),
    "guided_regex": (False, {"guided_regex": REGEX}, _full(REGEX), None),
    "guided_choice": (True, {"guided_choice": CHOICES}, _choice, None),
    # llguidance's grammar ends on the EOS after the last token, as xgrammar's (a matcher that
    # stopped at the last token lost that token's text: the router took it for a stop token)
    "guidance-choice": (True, {"guided_choice": CHOICES, "guided_decoding_backend": "guidance"},
                        _choice, None),
}
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "seed": 7}}


@pytest.fixture(scope="module")
def biases(model_dir: Path) -> dict[str, dict[str, float]]:
    """The cases' logit_bias by name (see CASES)."""
    from engine.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    calm = {str(i): -100.0 for i, t in enumerate(texts) if all(c.isspace() or ord(c) < 32 for c in t)}
    assert 100 < len(calm) <= 1024, len(calm)
    # A bias only ranks the tokens the grammar allows: the first '{' is still written.
    flat = {str(i): -100.0 for i, t in enumerate(texts) if "{" in t or "[" in t}
    ends = {str(i): {'"': 10.0, "}": 5.0}[t] for i, t in enumerate(texts) if t in ('"', "}")}
    terse = {**calm, **flat, **ends}
    assert len(terse) <= 1024, len(terse)
    return {"calm": calm, "terse": terse}


@pytest.fixture(scope="module")
def routers(workers: dict[str, WorkerServer], model_dir: Path) -> Iterator[dict[str, ServedRouter]]:
    """"split" (prefill -> KV store -> decode), "colocated", and "down" (its one decode target has
    nothing listening: every request that reaches a worker is a 503)."""
    dispatch = {"split": DispatchOptions(prefill=(workers["prefill"].target,),
                                         decode=(workers["decode"].target,), decode_timeout_s=60,
                          load_timeout_s=IN_LOOP_LOAD_TIMEOUT_S),
                "colocated": DispatchOptions(decode=(workers["colocated"].target,), decode_timeout_s=60,
                          load_timeout_s=IN_LOOP_LOAD_TIMEOUT_S),
                "down": DispatchOptions(decode=(f"127.0.0.1:{free_port()}",))}
    configs = {name: RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=d)
               for name, d in dispatch.items()}
    with ServedRouter(configs["split"]) as split, ServedRouter(configs["colocated"]) as colocated, \
            ServedRouter(configs["down"]) as down:
        yield {"split": split, "colocated": colocated, "down": down}


Sample = tuple[str, str | None, list[tuple[str, float]]]  # text, finish_reason, (token, logprob)s


async def _sample(router: ServedRouter, chat: bool, extra: dict[str, Any], stream: bool) -> Sample:
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0,
                                  timeout=120) as client:
        if chat:
            kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "logprobs": True}
            return await _chat(client, kw, extra, stream)
        kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "logprobs": 1}
        return await _completion(client, kw, extra, stream)


async def _chat(client: openai.AsyncOpenAI, kw: dict[str, Any], extra: dict[str, Any], stream: bool
                ) -> Sample:
    if not stream:
        choice = (await client.chat.completions.create(**kw, extra_body=extra)).choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        return (choice.message.content or "", choice.finish_reason,
                [(t.token, t.logprob) for t in choice.logprobs.content])
    text, finish, lps = "", None, []
    async for chunk in await client.chat.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            lps += [(t.token, t.logprob) for t in (c.logprobs.content or [])] if c.logprobs else []
    return text, finish, lps


async def _completion(client: openai.AsyncOpenAI, kw: dict[str, Any], extra: dict[str, Any], stream: bool
                      ) -> Sample:
    if not stream:
        choice = (await client.completions.create(**kw, extra_body=extra)).choices[0]
        assert choice.logprobs is not None
        return (choice.text, choice.finish_reason,
                list(zip(choice.logprobs.tokens or [], choice.logprobs.token_logprobs or [], strict=True)))
    text, finish, lps = "", None, []
    async for chunk in await client.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
            if c.logprobs:
                lps += list(zip(c.logprobs.tokens or [], c.logprobs.token_logprobs or [], strict=True))
    return text, finish, lps


def _same(a: Sample, b: Sample) -> None:
    assert a[:2] == b[:2]
    assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
    assert [lp for _, lp in a[2]] == pytest.approx([lp for _, lp in b[2]], abs=1e-5)


@in_module_loop
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
async def test_the_output_follows_the_constraint_and_split_equals_colocated(
        routers: dict[str, ServedRouter], biases: dict[str, dict[str, float]], case: Case) -> None:
    chat, fields, check, bias = case
    if bias is not None:
        fields = {**fields, "logit_bias": biases[bias]}
    runs = [(sampling, name, stream) for sampling in SAMPLING for name in ("split", "colocated")
            for stream in (False, True)]
    outs = await asyncio.gather(*(_sample(routers[name], chat, {**fields, **SAMPLING[sampling]}, stream)
                                  for sampling, name, stream in runs))
    got = dict(zip(runs, outs, strict=True))
    for sampling in SAMPLING:
        reference = got[(sampling, "colocated", False)]
        text, finish, _ = reference
        assert finish == "stop", (sampling, reference)  # the grammar ended, within max_tokens
        check(text)
        for name, stream in (("split", False), ("split", True), ("colocated", True)):
            _same(got[(sampling, name, stream)], reference)


def _bad(form: dict[str, Any], param: str) -> tuple[dict[str, Any], str]:
    return form, param


BAD = [
    _bad({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 5}}}},
         "response_format.json_schema.schema"),
    _bad({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    _bad({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": PERSON}}},
         "response_format.json_schema.name"),
    _bad({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
         "response_format.json_schema.schema"),
    _bad({"response_format": {"type": "yaml"}}, "response_format.type"),
    _bad({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    _bad({"structured_outputs": {"grammar": 'root ::= "a" missing'}}, "structured_outputs.grammar"),
    _bad({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    _bad({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    _bad({"guided_json": {"type": "object", "required": "name"}}, "guided_json"),
    _bad({"guided_grammar": "start: undefined"}, "guided_grammar"),
    _bad({"guided_choice": []}, "guided_choice"),
    _bad({"guided_regex": "[a-z]+", "response_format": {"type": "json_object"}}, "guided_regex"),
    _bad({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
]


@in_module_loop
@pytest.mark.parametrize(("fields", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
async def test_a_bad_form_or_spec_is_a_400_naming_the_field_before_any_worker(
        routers: dict[str, ServedRouter], fields: dict[str, Any], param: str) -> None:
    """Also on a router whose only worker is down: the 400 comes before any worker is asked
    (a request that passes is a 503 there)."""
    for name, chat in (("colocated", True), ("down", False), ("down", True)):
        async with openai.AsyncOpenAI(base_url=routers[name].base_url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:
                if chat:
                    await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=fields)
                else:
                    await client.completions.create(model=MODEL, prompt=PROMPT, extra_body=fields)
            assert e.value.status_code == 400 and e.value.param == param, (name, e.value.message)


@in_module_loop
async def test_a_good_constraint_on_a_router_without_workers_is_a_503(routers: dict[str, ServedRouter]
                                                                      ) -> None:
    async with openai.AsyncOpenAI(base_url=routers["down"].base_url, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"guided_regex": "a+"})
    assert e.value.status_code == 503


@in_module_loop
async def test_a_worker_refuses_an_uncompilable_spec_over_grpc_and_keeps_serving(
        workers: dict[str, WorkerServer]) -> None:
    """The router never sends one; a caller that does gets INVALID_ARGUMENT naming
    structured_outputs, from Prefill and Decode, with the backend chosen or not."""
    async def refused(call: Any) -> str:
        with pytest.raises(WorkerError) as e:
            await call
        assert e.value.kind == "invalid", e.value.message
        return e.value.message

    bad = [StructuredOutputsParams(regex="[0-", backend="xgrammar"),
           StructuredOutputsParams(grammar="root ::= nothing", backend="guidance"),
           StructuredOutputsParams(json='{"type": "objekt"}'),  # no backend: the engine's Processor checks it
           StructuredOutputsParams(choice=["a"], backend="outlines")]
    async with WorkerClient(workers["prefill"].target) as prefill, \
            WorkerClient(workers["decode"].target) as decode:
        for i, spec in enumerate(bad):
            params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec)
            for message in (await refused(prefill.prefill(f"bad-p{i}", [5, 6, 7], params)),
                            await refused(_drain(decode, f"bad-d{i}", params))):
                assert "INVALID_ARGUMENT" in message and "structured_outputs" in message, message
        three_digits = StructuredOutputsParams(regex="[0-9]{3}", backend="xgrammar")
        good = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=three_digits)
        chunks = [c async for c in decode.decode("good", [5, 6, 7], good)]
        assert chunks[-1].finish_reason == "stop" and sum(len(c.token_ids) for c in chunks) >= 3
        assert (await decode.load()).serving and (await prefill.load()).serving


async def _drain(client: WorkerClient, request_id: str, params: SamplingParams) -> None:
    async for _ in client.decode(request_id, [5, 6, 7], params):
        pass


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_top_logprobs_past_what_the_grammar_allows_are_clamped_not_a_500(
        routers: dict[str, ServedRouter], stream: bool) -> None:
    """A choice allows a handful of tokens per position: the rest of a top-20 have logprob -inf,
    which JSON cannot carry; they come back as -9999 (vLLM's floor), the reply a 200."""
    async with openai.AsyncOpenAI(base_url=routers["split"].base_url, api_key="x", max_retries=0,
                                  timeout=120) as client:
        kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "logprobs": True,
                              "top_logprobs": 20, "temperature": 0.0,
                              "extra_body": {"guided_choice": ["yes", "no"]}}
        tops: list[float] = []
        if stream:
            async for chunk in await client.chat.completions.create(**kw, stream=True):
                for c in chunk.choices:
                    for t in (c.logprobs.content or []) if c.logprobs else []:
                        tops += [x.logprob for x in t.top_logprobs]
        else:
            choice = (await client.chat.completions.create(**kw)).choices[0]
            assert choice.message.content in ("yes", "no")
            assert choice.logprobs is not None and choice.logprobs.content is not None
            tops = [x.logprob for t in choice.logprobs.content for x in t.top_logprobs]
    assert tops and min(tops) == -9999.0 and all(math.isfinite(x) for x in tops)
