"""Reasoning through the router's HTTP API and the official `openai` client, as vLLM's server with
`--reasoning-parser` gives it: the router (real app, uvicorn, a Qwen3-like thinking template) over a
scripted dispatcher whose "worker" writes a given text as the default model's token ids, a few per
step, so the router detokenizes, splits and streams exactly as it does a model's output.

Non-streamed and streamed replies agree: `<think>...</think>` is the message's `reasoning` and
`reasoning_content`, the rest its content, the Hermes tool calls parsed from the content only;
`chat_template_kwargs: {"enable_thinking": false}` reaches the template, and a reply without
tags is all content; `include_reasoning: false` drops the reasoning; with deepseek_r1 and a
prompt that opened the think block, the reply's reasoning needs no start tag. No
--reasoning-parser: the text is content, tags and all. The llama3_json and mistral tool-call
formats go through the same path.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator
from typing import Any, ClassVar

import openai
import pytest

from engine.sampling_params import SamplingParams
from services.router import app as router_app
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import Dispatcher, DispatchOptions, Step
from tests.integration.services.router_util import ServedRouter

# A ChatML template with Qwen3's thinking switch: enable_thinking false closes an empty think
# block after the generation prompt; think_in_prompt opens one there (Qwen3-Thinking-2507's and
# DeepSeek-R1's form); an assistant turn's reasoning_content is rendered in its think block.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and m.reasoning_content is defined -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- elif think_in_prompt is defined and think_in_prompt -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedDispatcher(Dispatcher):
    """Every sample writes `text` (its token ids, then EOS, `step` ids at a time) and records its
    prompt's ids; no worker is called (none is started: the pool's workers stay healthy)."""

    text = ""
    step = 3
    tokenizer: Any = None
    prompts: ClassVar[list[list[int]]] = []

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str = "") -> AsyncGenerator[Step, None]:
        cls = type(self)
        cls.prompts.append(list(prompt_ids))
        ids = [*cls.tokenizer(cls.text, add_special_tokens=False).input_ids, cls.tokenizer.eos_token_id]
        for i in range(0, len(ids), cls.step):
            yield Step(ids[i:i + cls.step], finish_reason="stop" if i + cls.step >= len(ids) else "")


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServedRouter]]:
    """Routers on the default model's tokenizer with the thinking template: qwen3 with Hermes
    tools, deepseek_r1, and one without a reasoning parser."""
    from engine.config import DEFAULT_MODEL
    from engine.model.loader import load_tokenizer, resolve_model_path

    ScriptedDispatcher.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    template = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)

    def config(**kw: Any) -> RouterConfig:
        return RouterConfig(model="m", tokenizer=DEFAULT_MODEL, max_model_len=512,
                            chat_template=str(template), dispatch=DispatchOptions(decode=("127.0.0.1:1",)),
                            **kw)

    configs = {"qwen3": config(reasoning_parser="qwen3", tool_call_parser="hermes",
                               enable_auto_tool_choice=True),
               "deepseek_r1": config(reasoning_parser="deepseek_r1"), "off": config(),
               # the other tool-call formats (no reasoning parser)
               "llama3_json": config(tool_call_parser="llama3_json", enable_auto_tool_choice=True),
               "mistral": config(tool_call_parser="mistral", enable_auto_tool_choice=True),
               "phi4_mini_json": config(tool_call_parser="phi4_mini_json", enable_auto_tool_choice=True)}
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(router_app, "Dispatcher", ScriptedDispatcher)
            served = {name: stack.enter_context(ServedRouter(c)) for name, c in configs.items()}
        yield served


Reply = tuple[str | None, str | None, list[tuple[str, str]], str]  # reasoning, content, calls, finish


async def _chat(router: ServedRouter, text: str, stream: bool, **kw: Any) -> Reply:
    """The scripted reply to one chat; streamed, put together as the openai client's users do."""
    ScriptedDispatcher.text = text
    args: dict[str, Any] = {"model": "m", "messages": ASK, "max_tokens": 100, **kw}
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60) as client:
        if not stream:
            out = await client.chat.completions.create(**args)
            message = out.choices[0].message
            extra = message.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            return extra.get("reasoning"), message.content, calls, out.choices[0].finish_reason
        reasoning, content, finish = "", "", ""
        parts: dict[int, list[str]] = {}  # each call's name and arguments
        async for chunk in await client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += delta.content or ""
            for c in delta.tool_calls or []:
                if c.id is not None:
                    parts[c.index] = [c.function.name, ""]
                else:
                    parts[c.index][1] += c.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        return reasoning or None, content or None, [(n, a) for n, a in parts.values()], finish


CASES: list[tuple[str, str, dict[str, Any], Reply]] = [
    # router, model text, request fields -> reasoning, content, calls, finish_reason
    ("qwen3", "<think>\nThe user says hi.\n</think>\n\nHello!", {},
     ("\nThe user says hi.\n", "\n\nHello!", [], "stop")),
    ("qwen3", "<think>\nI need the weather.\n</think>\n\n" + WEATHER_CALL, {"tools": TOOLS},
     ("\nI need the weather.\n", None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ("qwen3", "<think>Maybe " + WEATHER_CALL + "? No.</think>It is sunny.", {"tools": TOOLS},
     ("Maybe " + WEATHER_CALL + "? No.", "It is sunny.", [], "stop")),  # a call inside the reasoning is none
    ("qwen3", "Hello without thinking.", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
     (None, "Hello without thinking.", [], "stop")),
    ("qwen3", "<think>\nhidden\n</think>\n\nShown.", {"extra_body": {"include_reasoning": False}},
     (None, "\n\nShown.", [], "stop")),
    ("deepseek_r1", "9.8 is larger.\n</think>\n\n9.8",
     {"extra_body": {"chat_template_kwargs": {"think_in_prompt": True}}},
     ("9.8 is larger.\n", "\n\n9.8", [], "stop")),
    ("deepseek_r1", "Plain answer.", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
     (None, "Plain answer.", [], "stop")),
    ("off", "<think>x</think>y", {}, (None, "<think>x</think>y", [], "stop")),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', {"tools": TOOLS},
     (None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ("llama3_json", "It is sunny in Paris.", {"tools": TOOLS}, (None, "It is sunny in Paris.", [], "stop")),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     {"tools": TOOLS}, (None, "Checking.", [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
     {"tools": TOOLS},  # the v11 form
     (None, None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')], "tool_calls")),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', {"tools": TOOLS},
     (None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")),
    ("phi4_mini_json", "It is sunny in Paris.", {"tools": TOOLS},
     (None, "It is sunny in Paris.", [], "stop")),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", range(len(CASES)))
async def test_reasoning_and_content_streamed_and_not(routers: dict[str, ServedRouter], case: int) -> None:
    name, text, fields, expected = CASES[case]
    for step in (1, 4):
        ScriptedDispatcher.step = step
        assert await _chat(routers[name], text, stream=False, **fields) == expected
        assert await _chat(routers[name], text, stream=True, **fields) == expected


@pytest.mark.asyncio
async def test_enable_thinking_reaches_the_template(routers: dict[str, ServedRouter]) -> None:
    """chat_template_kwargs are the template's variables; an assistant turn's reasoning_content
    (or reasoning) is rendered by a template that reads it."""
    tok = ScriptedDispatcher.tokenizer
    history = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
               {"role": "user", "content": "Thanks"}]
    turn = "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\nSunny."
    for kwargs, tail in (({"enable_thinking": False}, "assistant\n<think>\n\n</think>\n\n"),
                         ({}, "<|im_start|>assistant\n"),
                         ({"enable_thinking": True}, "<|im_start|>assistant\n")):
        await _chat(routers["qwen3"], "ok", stream=False, messages=history,
                    extra_body={"chat_template_kwargs": kwargs})
        prompt = tok.decode(ScriptedDispatcher.prompts[-1])
        assert prompt.endswith(tail) and turn in prompt
        assert prompt.count("<think>") == (2 if kwargs == {"enable_thinking": False} else 1)

