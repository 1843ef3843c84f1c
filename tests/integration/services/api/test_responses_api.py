"""`/v1/responses` through the official clients, split (prefill -> KV store -> decode) and
colocated, on the tiny random model with pdserve's Hermes template and `--tool-call-parser
hermes --enable-auto-tool-choice` (what `pdserve up` runs):

- the openai client's `responses.create` (streamed and not), `responses.stream` and
  `responses.parse` give what chat completions give for the same request (greedy): the same
  text, tool calls and usage; the event stream joins into the final response;
- the openai-agents SDK's default Agent (its Responses model) runs a function tool, streamed and
  not;
- `store` / `previous_response_id` / GET / DELETE with the router's store on (a continued
  conversation answers as chat does with the whole conversation), each tenant's responses its own,
  and with it off (as vLLM's default);
- bad requests are 400s naming the Responses field, before any worker is called.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.server import WorkerServer
from tests.integration.services.router_util import IN_LOOP_LOAD_TIMEOUT_S, ServedRouter, serving

in_module_loop = pytest.mark.asyncio(loop_scope="module")
TOOLS_ON = {"chat_template": "hermes_tools", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather",
                               "parameters": WEATHER}]
CHAT_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
INSTRUCTIONS = "You are a terse assistant."
QUESTION = "What is the weather in Paris today?"
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def routers(workers: dict[str, WorkerServer], model_dir: Path) -> Iterator[dict[str, ServedRouter]]:
    def config(prefill: tuple[str, ...], decode: str, **kw: Any) -> RouterConfig:
        return RouterConfig(model="m", tokenizer=str(model_dir), max_model_len=512, **TOOLS_ON, **kw,
                            dispatch=DispatchOptions(prefill=prefill, decode=(decode,), decode_timeout_s=60,
                          load_timeout_s=IN_LOOP_LOAD_TIMEOUT_S))

    split = ((workers["prefill"].target,), workers["decode"].target)
    colocated = ((), workers["colocated"].target)
    configs = {"split": config(*split, enable_responses_store=True),
               "colocated": config(*colocated),
               "tenants": config(*colocated, enable_responses_store=True, api_keys=KEYS,
                                 tenant_cache_salt=True),
               # deepseek_r1: a reply starts in its reasoning (the random model never closes it)
               "reasoning": config(*split, reasoning_parser="deepseek_r1")}
    with serving(configs) as served:
        yield served


def _client(router: ServedRouter, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=120)


async def _streamed(client: openai.AsyncOpenAI, **kw: Any) -> tuple[Any, list[Any]]:
    """The final response of a streamed create, and its events (checked for order and joining)."""
    events = [e async for e in await client.responses.create(**kw, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    joined: dict[str, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.function_call_arguments.delta",
                      "response.reasoning_text.delta"):
            joined[e.item_id] = joined.get(e.item_id, "") + e.delta
    for item in final.output:
        text = item.arguments if item.type == "function_call" else item.content[0].text
        assert joined.get(item.id, "") == text
    assert [e.item for e in events if e.type == "response.output_item.done"] == final.output
    return final, events


@in_module_loop
@pytest.mark.parametrize("setup", ["split", "colocated"])
@pytest.mark.parametrize("mode", ["create", "stream-events", "stream-helper"])
async def test_a_response_is_the_chat_completion_of_the_same_request(
        routers: dict[str, ServedRouter], setup: str, mode: str) -> None:
    router = routers[setup]
    async with _client(router) as client:
        chat = await client.chat.completions.create(
            model="m", max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
        args: dict[str, Any] = {"model": "m", "instructions": INSTRUCTIONS, "input": QUESTION,
                                "max_output_tokens": 24, "temperature": 0}
        if mode == "create":
            response = await client.responses.create(**args)
        elif mode == "stream-events":
            response, _ = await _streamed(client, **args)
        else:
            async with client.responses.stream(**args) as stream:
                events = [e async for e in stream]
                # the helper's get_final_response() takes response.completed only (an SDK rule):
                # a reply cut at max_output_tokens ends in response.incomplete, which has it too
                response = (events[-1].response if events[-1].type == "response.incomplete"
                            else await stream.get_final_response())
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert "".join(deltas) == response.output_text
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "m"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    finish = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 24
    assert response.store is (setup == "split")  # the split router keeps responses, the other has no store


@in_module_loop
@pytest.mark.parametrize("setup", ["split", "colocated"])
@pytest.mark.parametrize("choice", ["required", "named"])
async def test_function_calls_are_the_chat_tool_calls_of_the_same_request(
        routers: dict[str, ServedRouter], setup: str, choice: str) -> None:
    chat_choice: Any = "required" if choice == "required" else {"type": "function",
                                                               "function": {"name": "get_weather"}}
    responses_choice: Any = ("required" if choice == "required"
                             else {"type": "function", "name": "get_weather"})
    async with _client(routers[setup]) as client:
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
            tool_choice=chat_choice, max_tokens=80, temperature=0)
        args = {"model": "m", "input": QUESTION, "tools": RESPONSES_TOOLS, "tool_choice": responses_choice,
                "max_output_tokens": 80, "temperature": 0}
        plain = await client.responses.create(**args)
        streamed, _ = await _streamed(client, **args)
    expected = [(c.function.name, json.loads(c.function.arguments))
                for c in chat.choices[0].message.tool_calls or []]
    assert expected, "the grammar makes at least one call"
    for response in (plain, streamed):
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), WEATHER)
            assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Berlin", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def calm(model_dir: Path) -> dict[str, float]:
    """A logit_bias banning the tokens that are only whitespace or control characters: given
    JSON's free whitespace, a random model writes nothing else (test_structured_outputs.py)."""
    from engine.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return {str(i): -100.0 for i, t in enumerate(texts) if all(c.isspace() or ord(c) < 32 for c in t)}


@in_module_loop
@pytest.mark.parametrize("setup", ["split", "colocated"])
async def test_parse_follows_the_schema_as_chat_response_format_does(
        routers: dict[str, ServedRouter], setup: str, calm: dict[str, float]) -> None:
    async with _client(routers[setup]) as client:
        parsed = await client.responses.parse(model="m", input=QUESTION, text_format=Forecast,
                                              max_output_tokens=100, temperature=0,
                                              extra_body={"logit_bias": calm})
        chat = await client.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": QUESTION}], response_format=Forecast,
            max_tokens=100, temperature=0, logit_bias=calm)
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.output_parsed == chat.choices[0].message.parsed
    assert parsed.text is not None and parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"


@in_module_loop
async def test_a_stored_response_is_retrieved_continued_and_deleted(routers: dict[str, ServedRouter]) -> None:
    router = routers["split"]
    async with _client(router) as client:
        first = await client.responses.create(model="m", input="Hello there.", max_output_tokens=12,
                                              temperature=0, instructions=INSTRUCTIONS)
        assert first.store is True
        got = await client.responses.retrieve(first.id)
        assert got.model_dump() == first.model_dump()
        assert first.completed_at is not None and first.completed_at >= first.created_at
        listed = await client.responses.input_items.list(first.id)
        assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [  # type: ignore[union-attr]
            ("message", "user", "Hello there.")]
        with pytest.raises(openai.BadRequestError):  # nothing runs in the background here
            await client.responses.cancel(first.id)
        second, _ = await _streamed(client, model="m", input="And then?", previous_response_id=first.id,
                                    max_output_tokens=12, temperature=0)
        # instructions do not carry over (OpenAI's rule): the conversation without them
        chat = await client.chat.completions.create(
            model="m", max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "Hello there."},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And then?"}])
        assert second.output_text == chat.choices[0].message.content
        assert second.previous_response_id == first.id
        assert second.usage is not None and chat.usage is not None
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        deleted = await client.responses.delete(first.id)
        assert deleted is None  # the client returns nothing for a 200
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="x", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


@in_module_loop
async def test_without_a_store_nothing_is_kept_and_continuing_says_why(
        routers: dict[str, ServedRouter]) -> None:
    async with _client(routers["colocated"]) as client:
        response = await client.responses.create(model="m", input="Hello.", max_output_tokens=4, store=True)
        assert response.store is False
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(response.id)
        assert "--enable-responses-store" in str(missing.value)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="m", input="x", previous_response_id=response.id)
        assert "--enable-responses-store" in str(e.value)


@in_module_loop
async def test_a_tenant_never_sees_another_tenants_responses(routers: dict[str, ServedRouter]) -> None:
    router = routers["tenants"]
    async with _client(router, KEYS[0]) as a, _client(router, KEYS[1]) as b:
        mine = await a.responses.create(model="m", input="Secret plans.", max_output_tokens=4)
        assert (await a.responses.retrieve(mine.id)).id == mine.id
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(mine.id)
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(model="m", input="x", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(mine.id)
        assert (await a.responses.retrieve(mine.id)).id == mine.id


@in_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_the_agents_sdk_default_agent_calls_a_function_tool(
        routers: dict[str, ServedRouter], stream: bool, model_dir: Path, calm: dict[str, float]) -> None:
    from engine.model.loader import load_tokenizer

    # The workers serve on this loop: importing the SDK (seconds) or loading a tokenizer on it
    # would leave their load reports unanswered, and the router takes a worker that misses five
    # in a row for a frozen one (a 503). Both run in a thread.
    await asyncio.to_thread(importlib.import_module, "agents")
    import agents

    # The SDK takes a reply cut at max_tokens for a model error: the call's JSON gets no free
    # whitespace (`calm`) and its city is an enum, and EOS is favoured, so the random model's
    # answer after the call ends at once (an empty message).
    eos = (await asyncio.to_thread(load_tokenizer, str(model_dir))).eos_token_id
    extra = {"logit_bias": {**calm, str(eos): 50.0}}

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Berlin", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    agents.set_tracing_disabled(True)  # no trace export (it would go to OpenAI)
    agents.set_default_openai_client(_client(routers["split"]), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model="m",
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0,
                                                             max_tokens=60, extra_body=extra))
    if stream:
        result: Any = agents.Runner.run_streamed(agent, QUESTION, max_turns=4)
        kinds = [e.type async for e in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = await agents.Runner.run(agent, QUESTION, max_turns=4)
    assert len(calls) == 1, "tool_choice required: one call, then the SDK resets tool_choice"
    items = [type(i).__name__ for i in result.new_items]
    assert items[:2] == ["ToolCallItem", "ToolCallOutputItem"]
    assert result.final_output == ""  # the empty answer EOS made
    assert all(isinstance(r.response_id, str) and r.response_id.startswith("resp_")
               for r in result.raw_responses)


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "image input": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                    "input[0].content[0].type"),
    "web search tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "background": ({"background": True}, "background"),
    "no output room": ({"max_output_tokens": 0}, "max_output_tokens"),
    "too long output": ({"max_output_tokens": 100_000}, "max_output_tokens"),
    "named tool missing": ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
                           "tool_choice"),
    "bad schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
                   "text.format"),
    "bad arguments": ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"},
                                 {"type": "function_call_output", "call_id": "c", "output": "1"}]},
                      "input[0].tool_calls[0].function.arguments"),
    "temperature": ({"temperature": 7.0}, "temperature"),
}


@in_module_loop
@pytest.mark.parametrize("case", list(BAD))
async def test_bad_requests_are_400s_naming_the_responses_field(
        routers: dict[str, ServedRouter], case: str) -> None:
    fields, param = BAD[case]
    async with httpx.AsyncClient(base_url=routers["colocated"].url, timeout=30) as http:
        r = await http.post("/v1/responses", json={"model": "m", "input": "hi", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@in_module_loop
async def test_a_wrong_model_is_a_404_and_a_large_body_is_prepared_off_the_loop(
        routers: dict[str, ServedRouter]) -> None:
    async with httpx.AsyncClient(base_url=routers["colocated"].url, timeout=60) as http:
        r = await http.post("/v1/responses", json={"model": "other", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        metadata = {f"k{i}": "v" * 500 for i in range(16)}  # an 8 KB body: over inline_bytes
        r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3,
                                                   "metadata": metadata})
        assert r.status_code == 200 and r.json()["metadata"] == metadata


@in_module_loop
async def test_scoring_a_prompt_with_echo_and_max_tokens_0_is_the_same_split_and_colocated(
        routers: dict[str, ServedRouter]) -> None:
    """(Completions, on this module's two setups: the split one scores on the prefill worker.)"""
    scored = {}
    for setup in ("split", "colocated"):
        async with _client(routers[setup]) as client:
            out = await client.completions.create(model="m", prompt=QUESTION, max_tokens=0, echo=True,
                                                  logprobs=1)
        choice = out.choices[0]
        assert choice.text == QUESTION and choice.finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 0
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        scored[setup] = choice.logprobs.token_logprobs
    assert scored["split"][0] is None and len(scored["split"]) == len(scored["colocated"])
    assert scored["split"][1:] == pytest.approx(scored["colocated"][1:], abs=1e-5)


@in_module_loop
async def test_reasoning_comes_back_as_a_reasoning_item_as_chat_gives_it(
        routers: dict[str, ServedRouter]) -> None:
    async with _client(routers["reasoning"]) as client:
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
        plain = await client.responses.create(model="m", input=QUESTION, max_output_tokens=16, temperature=0)
        streamed, events = await _streamed(client, model="m", input=QUESTION, max_output_tokens=16,
                                           temperature=0)
    reasoning = (chat.choices[0].message.model_extra or {})["reasoning_content"]
    assert reasoning and chat.usage is not None
    for response in (plain, streamed):
        assert [item.type for item in response.output] == ["reasoning"]
        item = response.output[0]
        assert item.content is not None and [c.text for c in item.content] == [reasoning]
        assert response.usage is not None
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning
