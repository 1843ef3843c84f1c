"""pdserve's chat template (services/router/templates/hermes_tools.jinja) through the tokenizer's
own renderer, as the router applies it: plain chats exactly as the default model's own template
renders them; tools listed in the system turn; an assistant's calls and the tools' results in the
Hermes / Qwen2.5 forms; and a call the model writes, parsed and sent back as history, renders as
the very text the model wrote (a two-turn conversation round-trips)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from services.router.api.openai_models import ChatCompletionRequest, ChatMessage
from services.router.api.tools import ChoiceCalls, ToolPlan, as_template_tools, chat_template_text

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Any, Any]:
    """The default model's tokenizer with its own chat template, and a copy with pdserve's."""
    from engine.config import DEFAULT_MODEL
    from engine.model.loader import load_tokenizer, resolve_model_path

    own = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    ours = copy.copy(own)
    ours.chat_template = chat_template_text("hermes_tools")
    return own, ours


def _render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            **kw: Any) -> str:
    """As the router renders: messages and tools through the request models first."""
    dicts = [ChatMessage.model_validate(m).as_template_dict() for m in messages]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    extra = {"tools": list(as_template_tools(body.tools))} if tools else {}
    text: str = tok.apply_chat_template(dicts, tokenize=False, **extra, **kw)
    return text


PLAIN_CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}],
    [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y"}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("chat", range(len(PLAIN_CHATS)))
def test_a_chat_without_tools_renders_as_the_models_own_template(tokenizers: tuple[Any, Any], chat: int,
                                                                  generation_prompt: bool) -> None:
    own, ours = tokenizers
    messages = PLAIN_CHATS[chat]
    assert _render(ours, messages, add_generation_prompt=generation_prompt) == \
        _render(own, messages, add_generation_prompt=generation_prompt)


def test_tools_are_listed_in_the_system_turn_as_sent(tokenizers: tuple[Any, Any]) -> None:
    _, ours = tokenizers
    for system in ([], [{"role": "system", "content": "You are a weather bot."}]):
        text = _render(ours, [*system, {"role": "user", "content": "Weather in Paris?"}], TOOLS,
                       add_generation_prompt=True)
        first_turn = text.split("<|im_end|>")[0]
        assert first_turn.startswith("<|im_start|>system\n" + (
            "You are a weather bot." if system else "You are a helpful AI assistant named SmolLM"))
        listed = re.search(r"<tools>\n(.*)\n</tools>", first_turn, re.S)
        assert listed is not None and [json.loads(line) for line in listed.group(1).split("\n")] == TOOLS
        assert "<tool_call>" in first_turn  # how to call them
        assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
        assert text.count("<|im_start|>system") == 1


def test_calls_and_results_render_in_the_hermes_forms(tokenizers: tuple[Any, Any]) -> None:
    _, ours = tokenizers
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "c2", "name": "get_time", "content": "14:00"},
    ]
    text = _render(ours, messages, TOOLS, add_generation_prompt=True)
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"sky\": \"sunny\"}\n</tool_response>\n"
                         "<tool_response>\n14:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_call_the_model_wrote_round_trips_through_the_history(tokenizers: tuple[Any, Any]) -> None:
    """Turn 1's prompt + the model's text == turn 2's history rendering, character for character."""
    _, ours = tokenizers
    turn1 = [{"role": "user", "content": "What's the weather in Zürich?"}]
    written = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}'
               '\n</tool_call>')
    content, calls = ChoiceCalls(ToolPlan("auto")).message(written)
    assert content == "I will check." and calls[0]["function"]["arguments"] == '{"city": "Zürich"}'
    reply = {"role": "assistant", "content": content, "tool_calls": calls}
    prompt = _render(ours, turn1, TOOLS, add_generation_prompt=True)
    history = _render(ours, [*turn1, reply], TOOLS, add_generation_prompt=False)
    assert history == prompt + written + "<|im_end|>\n"
    turn2 = [*turn1, reply, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "rain"}]
    assert _render(ours, turn2, TOOLS, add_generation_prompt=True) == (
        history + "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
                  "<|im_start|>assistant\n")


def test_default_system_can_be_replaced_through_a_template_variable(tokenizers: tuple[Any, Any]) -> None:
    _, ours = tokenizers
    text = _render(ours, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                   default_system="You are Bob.")
    assert text.startswith("<|im_start|>system\nYou are Bob.<|im_end|>\n")
