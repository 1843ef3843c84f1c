"""A Responses request as the chat request it runs as (vLLM serves its Responses API on its chat
path the same way): the conversation's items become chat messages, the Responses fields their
chat counterparts; the chat request's errors are named by the Responses fields they came from.

    body, names = chat_body(request, history)        # history: a stored conversation's messages
    chat = ChatCompletionRequest.model_validate(body)  # errors: rename(param, names)

Input items: messages (`{"role", "content"}`, with or without `"type": "message"`; content a
string or input_text / output_text / refusal parts), `function_call` items (an assistant's call:
consecutive ones join the assistant message before them, as one turn), `function_call_output`
(the tool message answering a call) and `reasoning` items (the next assistant turn's reasoning,
as chat's `reasoning_content`). Images, files and audio are refused: the server serves text
models; so are item references (send the item, or continue with previous_response_id).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pydantic

from services.router.errors import OpenAIError, field_path
from services.router.http.errors_http import is_union_tag
from services.router.responses.request import FunctionChoice, FunctionTool, ResponsesRequest

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "text": "text"}
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# vLLM's extra sampling fields, taken on /v1/responses as on chat (same names, same checks).
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
          "bad_words", "priority", "cache_salt", "skip_special_tokens", "include_stop_str_in_output",
          "spaces_between_special_tokens", "chat_template_kwargs", "structured_outputs")
# Chat fields -> the Responses fields they came from (for error messages).
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("tool_choice.function", "tool_choice"))


def chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The chat request's body, and for each of its messages the Responses field it came from."""
    messages: list[dict[str, Any]] = []
    names: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        names.append("instructions")
    messages += history
    names += ["previous_response_id"] * len(history)
    for message, name in input_messages(request.input):
        messages.append(message)
        names.append(name)
    _check_call_outputs(messages, names)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    extra = request.model_extra or {}
    body.update({k: extra[k] for k in PASSED if k in extra})
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.logprobs or request.top_logprobs:
        body["logprobs"], body["top_logprobs"] = True, request.top_logprobs or 0
    if request.tools is not None:
        body["tools"] = [_tool(t, i) for i, t in enumerate(request.tools)]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionChoice) else choice)
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise OpenAIError(400, "text.format: a json_schema format needs its name and schema",
                              "text.format")
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in spec.items() if v is not None}}
    if request.reasoning is not None and request.reasoning.effort is not None:
        variables = dict(body.get("chat_template_kwargs") or {})
        variables.setdefault("reasoning_effort", request.reasoning.effort)
        body["chat_template_kwargs"] = variables
    return body, names


def input_messages(items: str | list[Any] | None) -> list[tuple[dict[str, Any], str]]:
    """The chat messages of a request's input, each with the input item it came from."""
    if items is None:
        raise OpenAIError(400, "input: required (a text, or a list of items)", "input")
    if isinstance(items, str):
        return [({"role": "user", "content": items}, "input")]
    out: list[tuple[dict[str, Any], str]] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
    last_assistant = False  # the item before was the assistant's (a message or a call)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise OpenAIError(400, f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r:.40}",
                                  f"{where}.role")
            content = _text(item.get("content"), f"{where}.content")
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append((message, where))
            last_assistant = role == "assistant"
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if last_assistant and out:
                out[-1][0].setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                out.append((message, where))
            last_assistant = True
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append(({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text},
                        where))
            last_assistant = False
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise OpenAIError(400, f"{where}: item references are not supported by this server: send the "
                                   f"item itself, or continue a stored response with previous_response_id",
                              f"{where}.type")
        else:
            raise OpenAIError(400, f"{where}.type: {kind!r:.60} items are not supported by this server (it "
                                   f"takes messages, function_call, function_call_output and reasoning "
                                   f"items)", f"{where}.type")
    return out


def _check_call_outputs(messages: list[dict[str, Any]], names: list[str]) -> None:
    """Each function_call_output answers a call made earlier in the conversation (OpenAI's rule)."""
    calls: set[str] = set()
    for message, name in zip(messages, names, strict=True):
        calls.update(c["id"] for c in message.get("tool_calls") or [])
        if message["role"] == "tool" and message["tool_call_id"] not in calls:
            raise OpenAIError(400, f"{name}.call_id: no function call with call_id "
                                   f"{message['tool_call_id']!r:.80} precedes this output in the "
                                   f"conversation", f"{name}.call_id")


def input_items(items: str | list[Any] | None) -> list[dict[str, Any]]:
    """A request's input as OpenAI lists it (GET /v1/responses/{id}/input_items): items with an
    `id` and a `type`, a text input as one user message."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items or []:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(item["type"], "item")
        out.append({"id": f"{prefix}_{uuid.uuid4().hex}", **item})
    return out


def rename(param: str | None, names: list[str]) -> str | None:
    """A chat request's field as the Responses field it came from (`messages[3].content` ->
    `input[1].content`, `max_completion_tokens` -> `max_output_tokens`)."""
    if param is None:
        return None
    m = re.match(r"messages\[(\d+)\]", param)
    if m is not None and int(m.group(1)) < len(names):
        name = names[int(m.group(1))]
        rest = param[m.end():]
        return name if name != "input" and not name.startswith("input[") else name + rest
    m = re.match(r"tools\[(\d+)\]\.function", param)
    if m is not None:
        return f"tools[{m.group(1)}]" + param[m.end():]
    for chat, responses in _RENAMED:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return responses + param[len(chat):] if responses != "text.format" else "text.format"
    return param


def renamed(error: OpenAIError, names: list[str]) -> OpenAIError:
    """`error` with its param (and the message's leading field name) as the Responses field."""
    param = rename(error.param, names)
    message = error.message
    if error.param and param != error.param and message.startswith(error.param):
        message = f"{param}{message[len(error.param):]}"
    return OpenAIError(error.status, message, param, error.code, error.headers)


def validation_error(e: pydantic.ValidationError, names: list[str]) -> OpenAIError:
    """The 400 of a chat body that does not validate, named by the Responses field."""
    first = e.errors()[0]
    param = field_path(p for p in first.get("loc", ()) if not is_union_tag(p)) or None
    name = rename(param, names)
    msg = str(first.get("msg", "invalid value"))
    return OpenAIError(400, f"{name}: {msg}" if name else msg, name)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise OpenAIError(400, f"tools[{i}].type: {kind!r:.60} tools are not supported by this server (it "
                               f"runs function tools, which the client executes)", f"tools[{i}].type")
    try:
        spec = FunctionTool.model_validate(tool)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = field_path([f"tools[{i}]", *(p for p in first.get("loc", ()) if not is_union_tag(p))])
        raise OpenAIError(400, f"{param}: {first.get('msg')}", param) from None
    function = {"name": spec.name, "description": spec.description, "parameters": spec.parameters,
                "strict": spec.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{where}.{key}: a {item.get('type')} item needs {key} as a string",
                          f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or the text of its parts (in order)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            what = ("this server serves a text model" if kind in MEDIA_PARTS
                    else "parts are input_text, output_text or refusal")
            raise OpenAIError(400, f"{where}[{j}].type: {kind!r:.40} is not supported ({what})",
                              f"{where}[{j}].type")
        assert isinstance(part, dict)
        if not isinstance(part.get(key), str):
            raise OpenAIError(400, f"{where}[{j}].{key}: must be a string", f"{where}[{j}].{key}")
        texts.append(part[key])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                              for p in parts):
        raise OpenAIError(400, f"{where}.content: a reasoning item's content and summary are lists of "
                               f"parts with text", f"{where}.content")
    return "".join(p["text"] for p in parts)
