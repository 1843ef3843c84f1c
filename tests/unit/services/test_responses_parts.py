"""The Responses API's parts without a server: a request's items become the chat messages a chat
client would send for the same conversation; its fields the chat fields; chat errors are named by
the Responses field; the output builder turns a sample's text (reasoning, content, tool calls,
in any chunking) into the items and event sequence OpenAI's API defines, the stream joining into
the final body; the store is bounded by count and bytes and keeps tenants apart."""

from __future__ import annotations

import json
import random
from typing import Any

import pydantic
import pytest

from services.router.api.openai_models import ChatCompletionRequest
from services.router.api.reasoning import ReasoningPlan
from services.router.api.tools import ToolPlan
from services.router.errors import OpenAIError
from services.router.fanout import Delta
from services.router.http.render import Reply
from services.router.responses.convert import chat_body, rename, validation_error
from services.router.responses.output import OutputBuilder, Shape
from services.router.responses.request import ResponsesRequest
from services.router.responses.store import ResponseStore


def _request(**kw: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **kw})


def test_a_string_input_is_one_user_message_and_instructions_a_system_message_before_it() -> None:
    body, names = chat_body(_request(instructions="Be brief.", max_output_tokens=9, temperature=0.0), [])
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert names == ["instructions", "input"]
    assert body["max_completion_tokens"] == 9 and body["temperature"] == 0.0
    ChatCompletionRequest.model_validate(body)


def test_an_agent_loops_items_become_the_chat_conversation_a_chat_client_would_send() -> None:
    items = [
        {"role": "developer", "content": "You help."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    body, names = chat_body(_request(input=items), [{"role": "user", "content": "earlier"}])
    assert body["messages"] == [
        {"role": "user", "content": "earlier"},
        {"role": "developer", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    assert names == ["previous_response_id", "input[0]", "input[1]", "input[3]", "input[6]", "input[7]"]
    ChatCompletionRequest.model_validate(body)


def test_tools_tool_choice_and_text_format_become_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body, _ = chat_body(_request(
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": schema, "strict": True}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        reasoning={"effort": "low"}, include=["message.output_text.logprobs"], top_logprobs=3, seed=5), [])
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": schema, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False and body["seed"] == 5
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": schema, "strict": True}}
    assert body["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert chat_body(_request(text={"format": {"type": "json_object"}}), [])[0]["response_format"] == {
        "type": "json_object"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": None}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(
        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        chat_body(_request(**fields), [])
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param.split("[")[0])


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"), ({"service_tier": "flex"}, "service_tier"),
    ({"input": []}, "input"), ({"input": ["hi"]}, "input"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1"}, "input": None}, "prompt"),
])
def test_refused_fields_are_named_by_the_request_model(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(pydantic.ValidationError) as e:
        _request(**fields)
    assert e.value.errors()[0]["loc"][0] == param.split(".")[0]


def test_chat_errors_are_renamed_to_the_responses_fields() -> None:
    names = ["instructions", "input[0]", "input[2]"]
    assert rename("messages[2].tool_calls[0].function.arguments", names) == \
        "input[2].tool_calls[0].function.arguments"
    assert rename("messages[0].content", names) == "instructions"
    assert rename("max_completion_tokens", names) == "max_output_tokens"
    assert rename("response_format.json_schema.schema", names) == "text.format"
    assert rename("tools[1].function.parameters", names) == "tools[1].parameters"
    assert rename("temperature", names) == "temperature"
    body, names = chat_body(_request(temperature=9.0), [])
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    assert validation_error(e.value, names).param == "temperature"
    bad = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]
    answer = {"type": "function_call_output", "call_id": "c", "output": ""}
    body, names = chat_body(_request(input=[*bad, answer]), [])
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    assert validation_error(e.value, names).param == "input[0].tool_calls[0].function.arguments"


def _call(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


TEXT = "<think>\nThe user wants weather.\n</think>\n\nChecking." + _call("get_weather", {"city": "Paris"})


def _builder(tools: bool, reasoning: bool, **kw: Any) -> OutputBuilder:
    reply = Reply(None, "m", "resp_x", (7,), 1, True, False,  # type: ignore[arg-type]
                  tools=ToolPlan("auto", parser_name="hermes") if tools else None,
                  reasoning=ReasoningPlan("qwen3") if reasoning else None)
    return OutputBuilder(Shape("resp_x", _request(**kw), reply, stored=False))


def _run(build: OutputBuilder, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    events = build.start()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += build.feed(Delta(0, piece, [i], [], finish if last else None, i + 1, 2))
    return events + build.finish_events()


def _chunks(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reasoning_content_and_a_call_give_three_items_and_the_stream_joins_into_the_body(seed: int) -> None:
    build = _builder(tools=True, reasoning=True)
    events = _run(build, _chunks(TEXT, seed))
    body = build.body()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == body
    assert body["status"] == "completed" and body["incomplete_details"] is None
    reasoning, message, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "\nThe user wants weather.\n"}]
    assert message["type"] == "message" and message["content"][0]["text"] == "\n\nChecking."
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "get_weather", {"city": "Paris"})
    assert all(item["status"] == "completed" for item in body["output"])
    # the stream, as a client puts it together, is the body's output
    joined: dict[str, str] = {}
    for e in events:
        if e["type"] in ("response.reasoning_text.delta", "response.output_text.delta",
                         "response.function_call_arguments.delta"):
            joined[e["item_id"]] = joined.get(e["item_id"], "") + e["delta"]
    assert joined == {reasoning["id"]: reasoning["content"][0]["text"],
                      message["id"]: message["content"][0]["text"], call["id"]: call["arguments"]}
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == body["output"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]
    kinds = [e["type"] for e in events if "delta" not in e["type"]]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    usage = body["usage"]
    assert usage["input_tokens"] == 7 and usage["output_tokens"] == len(_chunks(TEXT, seed))
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    assert build.chat_messages() == [{"role": "assistant", "content": "\n\nChecking.",
                                      "reasoning_content": "\nThe user wants weather.\n",
                                      "tool_calls": [{"id": call["call_id"], "type": "function",
                                                      "function": {"name": "get_weather",
                                                                   "arguments": call["arguments"]}}]}]


def test_a_reply_cut_at_max_output_tokens_is_incomplete() -> None:
    build = _builder(tools=False, reasoning=False, max_output_tokens=3)
    events = _run(build, ["a", "b", "c"], finish="length")
    body = build.body()
    assert events[-1]["type"] == "response.incomplete"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == "abc"
    assert body["max_output_tokens"] == 3 and body["usage"]["output_tokens"] == 3


def test_a_failure_mid_stream_closes_the_open_item_and_fails_the_response() -> None:
    build = _builder(tools=False, reasoning=False)
    events = build.start() + build.feed(Delta(0, "par", [1], [], None, 1, 0))
    events += build.fail("worker_unavailable", "the worker went away")
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.failed"]
    error = events[-1]["response"]["error"]
    assert error == {"code": "worker_unavailable", "message": "the worker went away"}
    assert events[-1]["response"]["status"] == "failed"


def _body(i: int, text: str = "x") -> dict[str, Any]:
    return {"id": f"resp_{i}", "text": text}


def test_the_store_keeps_the_most_recently_used_within_its_count_and_bytes_and_tenants_apart() -> None:
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(4):
        assert store.put("", _body(i), [{"role": "user", "content": str(i)}])
    assert store.get("", "resp_0") is None and len(store) == 3
    assert store.get("", "resp_1") is not None  # now the most recent
    store.put("", _body(4), [])
    assert store.get("", "resp_2") is None and store.get("", "resp_1") is not None
    assert store.get("tenant-b", "resp_1") is None  # another tenant's id does not exist for it
    assert not store.delete("tenant-b", "resp_1") and store.delete("", "resp_1")
    small = ResponseStore(max_responses=100, max_bytes=300)
    assert not small.put("", _body(0, "y" * 400), [])  # larger than the whole store: not kept
    for i in range(10):
        small.put("", _body(i, "z" * 50), [])
    assert small.bytes <= 300 and 0 < len(small) < 10
