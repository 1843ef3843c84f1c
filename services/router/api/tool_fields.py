"""The request fields of tool calling, as OpenAI and vLLM write them (only their form is checked
here; services/router/api/tools.py checks them against each other and the router's flags):

- `tools`: `[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`;
- `tool_choice`: "none", "auto", "required" or `{"type": "function", "function": {"name": ...}}`;
- `parallel_tool_calls`: false for at most one call;
- in a conversation's history, an assistant message's `tool_calls` (`ToolCall`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictStr, field_validator

MAX_TOOLS = 128  # OpenAI's limit on a request's tools (and on one message's calls)


class FunctionCall(BaseModel):
    """A call an assistant made, as a conversation's history holds it."""

    name: StrictStr
    arguments: StrictStr  # JSON text; "" is no arguments

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, v: str) -> str:
        try:
            json.loads(v or "{}")
        except ValueError as e:
            raise ValueError(f"must be JSON text (the call's arguments): {e}") from None
        return v


class ToolCall(BaseModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    # OpenAI's: 1-64 letters, digits, underscores and dashes.
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    # A JSON schema of the arguments (checked against its metaschema in tools.py); none: no arguments.
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # enforced only by tool_choice "required" or named (grammar)


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


def _tool_choice(v: object) -> object:
    if isinstance(v, str) and v not in ("none", "auto", "required"):
        raise ValueError(f'must be "none", "auto", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {v!r:.40}')
    return v


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_tool_choice)]


class ToolFields(BaseModel):
    """Functions the model may call: tool_choice "auto" (the default with tools) lets it choose,
    "required" makes it call one or more, a named one that one."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call
