"""Tool calling in chat, as vLLM's OpenAI server does it: what a request's `tools`, `tool_choice`
and `parallel_tool_calls` ask of its prompt, its sampling and its reply.

    plan = tool_plan(body, auto_tools=True)    # a 400 naming the field, before any worker call
    template = replace(template, tools=plan.template_tools)     # the chat template lists them
    constrain(fields, plan)                    # "required" / named: a grammar in SamplingParams
    calls = ChoiceCalls(plan)                  # one per choice, when plan.parses
    chunk_deltas = calls.deltas(delta.text, finished)           # streamed: OpenAI delta bodies
    content, tool_calls = calls.message(text)  # non-streamed

tool_choice "none" (the default without tools): the text is all content. "auto" (the default with
tools; needs the router's --enable-auto-tool-choice and --tool-call-parser): no constraint, the
parser finds the calls the model wrote. "required": the output is a JSON array of one or more
`{"name", "parameters"}`, one of the tools each; named: the output is that function's arguments.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.structured.params import StructuredOutputsParams
from engine.structured.select import choose_backend
from services.router.api.json_tool_parsers import Llama3JsonParser, MistralParser, Phi4MiniJsonParser
from services.router.api.openai_models import ChatCompletionRequest
from services.router.api.tool_fields import NamedToolChoice, Tool
from services.router.api.tool_parser import (
    CallStart,
    Content,
    Event,
    HermesParser,
    NamedParser,
    RequiredParser,
    ToolParser,
)
from services.router.errors import OpenAIError

# --tool-call-parser (vLLM's names): how "auto" finds the calls in a reply's text.
_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "phi4_mini_json": Phi4MiniJsonParser}
TOOL_CALL_PARSERS = tuple(_PARSERS)
# Parsers whose tags are special tokens: requests parsed by them keep special tokens in the text.
SPECIAL_TOKEN_PARSERS = ("mistral",)
Choose = Callable[[StructuredOutputsParams], StructuredOutputsParams]
TEMPLATES = Path(__file__).parents[1] / "templates"  # the chat templates pdserve ships, by name
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def chat_template_text(value: str) -> str:
    """The text of --chat-template: a Jinja file, or the name of one pdserve ships
    (`hermes_tools`); ValueError naming both forms otherwise."""
    path = Path(value)
    if not path.is_file() and (TEMPLATES / f"{value}.jinja").is_file():
        path = TEMPLATES / f"{value}.jinja"
    try:
        return path.read_text()
    except OSError as e:
        shipped = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise ValueError(f"chat_template: {value!r} is neither a readable file ({e.strerror}) nor a "
                         f"template pdserve ships ({shipped})") from None


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask for; `choice` is "none", "auto", "required" or "named"."""

    choice: str = "none"
    name: str | None = None  # the named function
    template_tools: tuple[dict[str, Any], ...] = ()  # the chat template's `tools`
    constraint: StructuredOutputsParams | None = None  # the output's grammar
    parallel: bool = True  # false: only the first call is returned
    parser_name: str = "hermes"  # --tool-call-parser: how "auto" finds calls in free text

    @property
    def parses(self) -> bool:
        """Whether replies are parsed into calls (else their text is all content)."""
        return self.choice != "none"

    def parser(self) -> ToolParser:
        if self.choice == "named":
            assert self.name is not None
            return NamedParser(self.name)
        if self.choice == "required":
            return RequiredParser()
        return _PARSERS.get(self.parser_name, HermesParser)()

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the text this plan parses must keep special tokens (the parser's tags)."""
        return self.choice == "auto" and self.parser_name in SPECIAL_TOKEN_PARSERS

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when "auto" or "required" calls ended the sample, the sample's
        own reason for a named function (as vLLM and OpenAI)."""
        return "tool_calls" if called and engine_reason == "stop" and self.choice != "named" \
            else engine_reason


def tool_plan(body: ChatCompletionRequest, auto_tools: bool, choose: Choose | None = None,
              parser_name: str = "hermes") -> ToolPlan:
    """The request's ToolPlan, or a 400 naming the field; `auto_tools`: the router parses calls
    out of free text (--enable-auto-tool-choice with a --tool-call-parser); `choose` gives a
    spec its backend or raises a 400 naming the spec's source (the router's BackendChoices,
    with its --structured-outputs-backend; by default, choose_backend's "auto")."""
    choose = choose or _choose_auto
    tools = body.tools or []
    _check_tools(tools, choose)
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if choice == "required" or named is not None or (choice == "auto" and tools):
        _check_choice(choice, named, tools, auto_tools)  # "auto" without tools: nothing to call
    template_tools = as_template_tools(tools)
    parallel = body.parallel_tool_calls is not False
    if not tools or choice in ("none", "auto"):
        return ToolPlan("auto" if tools and choice == "auto" else "none", None, template_tools,
                        None, parallel, parser_name)
    schema = _named_schema(tools, named) if named else _required_schema(tools, parallel)
    # No free whitespace between JSON tokens (the separators json.dumps writes): arguments are read
    # by programs, and a weak model given free whitespace can spend every token on newlines.
    spec = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True, source="tool_choice")
    return ToolPlan("named" if named else "required", named, template_tools, choose(spec), parallel)


def constrain(fields: dict[str, Any], plan: ToolPlan) -> None:
    """Puts the plan's grammar into a sample's SamplingParams fields. A sample follows one
    grammar: one there already (response_format, structured_outputs) is a 400."""
    if plan.constraint is None:
        return
    other = fields.get("structured_outputs")
    if other is not None:
        what = "a named function" if plan.choice == "named" else f'"{plan.choice}"'
        raise OpenAIError(400, f"tool_choice: {what} constrains the output, and so does {other.source}: "
                               f"send one of them", "tool_choice")
    fields["structured_outputs"] = plan.constraint


def as_template_tools(tools: list[Tool] | None) -> tuple[dict[str, Any], ...]:
    """The tools as the chat template reads them (as sent, without the fields left out)."""
    return tuple(t.model_dump(exclude_none=True) for t in tools or ())


def _choose_auto(params: StructuredOutputsParams) -> StructuredOutputsParams:
    try:
        return choose_backend(params)
    except ValueError as e:
        raise OpenAIError(400, str(e), params.source) from e


def _check_tools(tools: list[Tool], choose: Choose) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise OpenAIError(400, f"tools[{i}].function.name: {fn.name!r} is offered twice",
                              f"tools[{i}].function.name")
        seen.add(fn.name)
        if fn.parameters is not None:  # the schema against its metaschema, and that it compiles
            choose(StructuredOutputsParams(json=json.dumps(fn.parameters),
                                           source=f"tools[{i}].function.parameters"))


def _check_choice(choice: object, named: str | None, tools: list[Tool], auto_tools: bool) -> None:
    label = f"the function {named!r}" if named else repr(choice)
    if not tools:
        raise OpenAIError(400, f"tool_choice: {label} needs tools, and the request offers none",
                          "tool_choice")
    if named is not None and named not in {t.function.name for t in tools}:
        raise OpenAIError(400, f"tool_choice: {named!r} is not one of the request's tools",
                          "tool_choice")
    if choice == "auto" and not auto_tools:
        raise OpenAIError(400, 'tool_choice: "auto" (the default with tools) needs the router\'s '
                               "--enable-auto-tool-choice and --tool-call-parser (as vLLM); send "
                               '"none", "required" or a named function', "tool_choice")


def _named_schema(tools: list[Tool], name: str) -> dict[str, Any]:
    """A named function's output: its arguments object."""
    fn = next(t.function for t in tools if t.function.name == name)
    return fn.parameters or _NO_PARAMETERS


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """tool_choice "required" (vLLM's form): a JSON array of one or more calls, each a tool's name
    and its parameters; the tools' `$defs` move to the root, where their `$ref`s point."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.function.parameters or _NO_PARAMETERS)
        for key, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, definition) != definition:
                raise OpenAIError(400, f"tools[{i}].function.parameters: $defs.{key} differs from "
                                       f"another tool's (they share the grammar's root)",
                                  f"tools[{i}].function.parameters")
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ChoiceCalls:
    """One choice's reply through its ToolPlan's parser: streamed deltas or the whole message."""

    plan: ToolPlan
    parser: ToolParser = field(init=False)
    called: bool = False

    def __post_init__(self) -> None:
        self.parser = self.plan.parser()

    def events(self, text: str, finished: bool) -> list[Event]:
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        if not self.plan.parallel:  # vLLM's: only the first call is returned
            events = [e for e in events if isinstance(e, Content) or e.index == 0]
        self.called = self.called or any(isinstance(e, CallStart) for e in events)
        return events

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The chat chunk deltas of the next piece of text (several when it completes a call:
        its header, then its arguments)."""
        out: list[dict[str, Any]] = []
        for e in self.events(text, finished):
            if isinstance(e, Content) and out and "content" in out[-1]:
                out[-1]["content"] += e.text
            elif isinstance(e, Content):
                out.append({"content": e.text})
            elif isinstance(e, CallStart):
                out.append({"tool_calls": [{"index": e.index, "id": _call_id(), "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole sample's content (None when it is only calls) and its calls."""
        content, calls = "", dict[int, dict[str, Any]]()  # calls by index
        for e in self.events(text, finished=True):
            if isinstance(e, Content):
                content += e.text
            elif isinstance(e, CallStart):
                calls[e.index] = {"id": _call_id(), "type": "function",
                                  "function": {"name": e.name, "arguments": ""}}
            else:
                calls[e.index]["function"]["arguments"] += e.text
        return (content or None) if calls else content, list(calls.values())


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"

