"""Tool calling through the official `openai` client, as vLLM's OpenAI server does it, on routers
started with pdserve's Hermes chat template, `--tool-call-parser hermes` and
`--enable-auto-tool-choice` (what `pdserve up` runs).

On the tiny random model, colocated and split (prefill -> KV store -> decode): tool_choice
"required" and a named function give calls whose arguments validate against the function's
parameters (the grammar made them), the same streamed and not, split and colocated. On the
default model, tool_choice "auto": the model writes a <tool_call> (greedy, a conversation in
which it called the tool before), the hermes parser returns it; the tool's result sent back gets
an answer. Bad requests are 400s naming the field, before any worker is called.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from kvstore.service import KVStoreService
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.conftest import engine_config, running_together, worker_options
from tests.integration.services.router_util import ServedRouter, serving

in_module_loop = pytest.mark.asyncio(loop_scope="module")
TOOLS_ON = {"chat_template": "hermes_tools", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]},
                                             "unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}},
        "required": ["tz", "precise"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
REAL_LEN = 1024  # the default model's worker: a few turns with the tools listed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(model_dir: Path, default_model_dir: Path, store: KVStoreService
                  ) -> AsyncIterator[dict[str, WorkerServer]]:
    """Prefill, decode and colocated workers on the tiny model, a colocated one on the default
    model ("real"), started together."""
    specs = {role: worker_options(model_dir, store, role) for role in ("prefill", "decode", "colocated")}
    real = engine_config(default_model_dir, store.location)
    specs["real"] = replace(worker_options(default_model_dir, store, "colocated"),
                            engine=replace(real, max_model_len=REAL_LEN, num_kv_blocks=REAL_LEN // 16 + 8))
    async with running_together({name: WorkerServer(o) for name, o in specs.items()}) as started:
        yield started


@pytest.fixture(scope="module")
def routers(servers: dict[str, WorkerServer], model_dir: Path, default_model_dir: Path
            ) -> Iterator[dict[str, ServedRouter]]:
    def config(tokenizer: Path, decode: str, prefill: tuple[str, ...] = (), max_model_len: int = 512,
               **tools: Any) -> RouterConfig:
        return RouterConfig(model="m", tokenizer=str(tokenizer), max_model_len=max_model_len, **tools,
                            dispatch=DispatchOptions(prefill=prefill, decode=(decode,), decode_timeout_s=60))

    configs = {"colocated": config(model_dir, servers["colocated"].target, **TOOLS_ON),
               "split": config(model_dir, servers["decode"].target, (servers["prefill"].target,), **TOOLS_ON),
               "no-auto": config(model_dir, servers["colocated"].target),
               "real": config(default_model_dir, servers["real"].target, max_model_len=REAL_LEN, **TOOLS_ON)}
    with serving(configs) as served:
        yield served


def _client(router: ServedRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=120)


Reply = tuple[str | None, list[tuple[str, str]], str]  # content, calls (name, arguments), finish


async def _chat(router: ServedRouter, stream: bool, **kw: Any) -> Reply:
    """One choice's reply; streamed, put together as the openai client's users do (each call's
    id, type and name from its first chunk, its arguments concatenated)."""
    args: dict[str, Any] = {"model": "m", "temperature": 0, "max_tokens": 80, **kw}
    async with _client(router) as client:
        if not stream:
            out = await client.chat.completions.create(**args)
            message = out.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
                       for c in message.tool_calls or [])
            return message.content or None, calls, out.choices[0].finish_reason
        content, calls, ids, finish = "", dict[int, list[str]](), set(), ""
        async for chunk in await client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                if c.id is not None:  # a call's first chunk: its id, type and name, no arguments yet
                    assert c.index not in calls and c.type == "function" and c.function.arguments == ""
                    calls[c.index], ids = [c.function.name, ""], ids | {c.id}
                else:
                    calls[c.index][1] += c.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert len(ids) == len(calls)
        return content or None, [(n, a) for n, a in calls.values()], finish


def _valid(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """Each call's name and arguments, the arguments checked against its function's parameters."""
    out = []
    for name, arguments in calls:
        value = json.loads(arguments)
        jsonschema.validate(value, PARAMETERS[name])
        out.append((name, value))
    return out


CONSTRAINED: dict[str, dict[str, Any]] = {
    "required": {"tool_choice": "required"},
    "required-one-call": {"tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "required-seeded": {"tool_choice": "required", "temperature": 1.0, "seed": 7},
}


@in_module_loop
@pytest.mark.parametrize("case", list(CONSTRAINED))
async def test_required_and_named_calls_validate_and_agree_streamed_split_and_colocated(
        routers: dict[str, ServedRouter], case: str) -> None:
    kw = {"messages": ASK, "tools": TOOLS, **CONSTRAINED[case]}
    replies = {(name, stream): await _chat(routers[name], stream, **kw)
               for name in ("colocated", "split") for stream in (False, True)}
    content, calls, finish = replies["colocated", False]
    assert all(r == replies["colocated", False] for r in replies.values()), replies
    assert calls and _valid(calls)
    if case == "named":
        assert [name for name, _ in calls] == ["get_time"] and finish == "stop"  # as OpenAI and vLLM
    elif finish == "length":  # a random model may add calls until max_tokens: a cut one is content
        assert content is not None and content.startswith('{"name": ')
    else:
        assert finish == "tool_calls"
    if finish != "length":
        assert content is None
    if case == "required-one-call":
        assert len(calls) == 1 and finish == "tool_calls"


@in_module_loop
async def test_the_default_model_writes_a_call_that_auto_returns(routers: dict[str, ServedRouter]) -> None:
    """Greedy, after two turns in which it called get_weather (the history holds the calls), the
    model calls it for the city asked now; the hermes parser returns the call, streamed or not."""
    asked = [_turn("Paris", 1)[:2], _turn("Rome", 2)[:2], [_question("Berlin")]]
    messages = [m for turn in asked for m in turn]
    replies = [await _chat(routers["real"], stream, messages=messages, tools=TOOLS)
               for stream in (False, True)]
    assert replies[0] == replies[1]
    content, calls, finish = replies[0]
    assert (content, finish) == (None, "tool_calls")
    [(name, arguments)] = _valid(calls)  # its own words, not a grammar's: still a valid call
    assert name == "get_weather" and arguments["city"] == "Berlin"


@in_module_loop
async def test_a_tool_result_sent_back_gets_an_answer(routers: dict[str, ServedRouter]) -> None:
    """Two turns after a whole earlier exchange: the call (get_weather named, so the grammar makes
    it), then its result sent back as history, which the model answers in words (tool_choice
    "auto": its text is content)."""
    history = [*_turn("Paris", 1), _question("Berlin")]
    async with _client(routers["real"]) as client:
        first = await client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                                     tool_choice=_named("get_weather"),
                                                     temperature=0, max_tokens=40)
        call = first.choices[0].message.tool_calls[0]
        assert _valid([(call.function.name, call.function.arguments)])[0][1]["city"] == "Berlin"
        history += [first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 24}'}]
        second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                                      temperature=0, max_tokens=40)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content and "Berlin" in answer.message.content and "24" in answer.message.content


def _question(city: str) -> dict[str, Any]:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def _turn(city: str, k: int) -> list[Any]:
    """One exchange: the question, the assistant's call, the tool's result, the answer."""
    arguments = json.dumps({"city": city, "unit": "celsius"})
    call = {"id": f"call-{k}", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    result = json.dumps({"sky": "sunny", "celsius": 20 + k})
    return [_question(city), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call-{k}", "content": result},
            {"role": "assistant", "content": f"It is sunny and {20 + k} degrees in {city}."}]


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "functions", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": _named("get_date")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": _named("get_time")}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
]


@in_module_loop
async def test_bad_tool_requests_are_400s_naming_the_field_before_any_worker_call(
        routers: dict[str, ServedRouter]) -> None:
    router = routers["colocated"]
    prompts_before = router.metric("vllm:prompt_tokens_total")
    async with _client(router) as client:
        for extra, param in BAD:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(**{"model": "m", "messages": ASK, "max_tokens": 4,
                                                            "stream": stream, **extra})
                assert e.value.status_code == 400 and e.value.param in param.split("|"), (extra, e.value)
    assert router.metric("vllm:prompt_tokens_total") == prompts_before  # nothing was admitted


@in_module_loop
async def test_auto_needs_the_routers_flags_and_none_parses_nothing(routers: dict[str, ServedRouter]) -> None:
    """As vLLM: tools with tool_choice "auto" (their default) need --enable-auto-tool-choice and
    --tool-call-parser; "none" and the constrained choices do not."""
    async with _client(routers["no-auto"]) as client:
        for choice in ({}, {"tool_choice": "auto"}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, **choice)
            assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    content, calls, _ = await _chat(routers["no-auto"], False, messages=ASK, tools=TOOLS, tool_choice="none",
                                    max_tokens=8)
    assert content and not calls
    assert (await _chat(routers["no-auto"], False, messages=ASK, tools=TOOLS,
                        tool_choice=_named("get_time")))[1]


@in_module_loop
async def test_tokenize_with_tools_counts_what_the_chat_prefills(routers: dict[str, ServedRouter]) -> None:
    import httpx

    router = routers["real"]
    async with _client(router) as client:
        out = await client.chat.completions.create(model="m", messages=_turn("Rome", 1), tools=TOOLS,
                                                   max_tokens=1)
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        tokens = (await http.post("/tokenize", json={"messages": _turn("Rome", 1), "tools": TOOLS})).json()
    assert out.usage is not None and tokens["count"] == out.usage.prompt_tokens
