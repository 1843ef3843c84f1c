"""The body of `POST /v1/responses` (OpenAI's Responses API, as vLLM serves it), validated at the
edge; services/router/responses/convert.py turns it into the chat request it runs as.

Only its form is checked here (each error a 400 naming the field); what the fields mean together
(tools and tool_choice, the structured-output format, the conversation) is checked when the chat
request is made. OpenAI fields this server does not do are refused with a 400 naming them unless
they ask for nothing (`"background": false`); fields neither OpenAI's nor vLLM's API defines are
ignored with a debug log line, as on the other endpoints.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, field_validator

from services.router.api import unsupported
from services.router.api.openai_models import TokenCount, TopLogprobs
from services.router.api.tool_fields import MAX_TOOLS

MAX_INPUT_ITEMS = 4096  # a conversation's items (messages, calls, call outputs)
MAX_METADATA = 16  # OpenAI's: 16 pairs, keys of at most 64 characters, values of at most 512
# What `include` may ask for: the output text's logprobs (with top_logprobs). Reasoning's
# encrypted content and the built-in tools' outputs have nothing to return here.
INCLUDABLE = ("message.output_text.logprobs",)


def _no_background(v: Any) -> bool:
    return v is None or v is False


def _no_conversation(v: Any) -> bool:
    return v is None


def _default_tier(v: Any) -> bool:
    return v is None or v in ("auto", "default")


def _medium(v: Any) -> bool:
    return v is None or v == "medium"


# Responses fields refused unless they ask for nothing (unsupported.py's form: field -> (no-op, what)).
REFUSED: dict[str, tuple[unsupported.NoOp, str]] = {
    "background": (_no_background, "runs the response in the background"),
    "conversation": (_no_conversation, "adds the response to a stored conversation"),
    "prompt": (_no_conversation, "renders a stored prompt template"),
    "max_tool_calls": (_no_conversation, "limits the built-in tools' calls"),
    "service_tier": (_default_tier, "runs on another service tier"),
}


class FunctionTool(BaseModel):
    """A function the model may call (the Responses form: no nested `function` object)."""

    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(BaseModel):
    """tool_choice naming one function."""

    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(BaseModel):
    format: TextFormat | None = None
    verbosity: Annotated[Literal["low", "medium", "high"] | None, Field(
        description="only medium (the model's own verbosity) is served")] = None

    @field_validator("verbosity")
    @classmethod
    def _served(cls, v: str | None) -> str | None:
        if not _medium(v):
            raise ValueError(f"not supported by this server (the model writes at its own length): "
                             f"leave it out or send \"medium\", got {v!r}")
        return v


class ReasoningOptions(BaseModel):
    # Given to the chat template as `reasoning_effort` (as vLLM does): templates that read it
    # (gpt-oss's) follow it; others render as without it.
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    # Summaries are not written: the reasoning item carries the model's reasoning text itself.
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None


class StreamOptions(BaseModel):
    include_obfuscation: StrictBool | None = None  # no obfuscation field is ever sent


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    # Required (checked after the refused fields, so `prompt` alone is named as refused): a text,
    # or a list of items (objects: messages, function_call, function_call_output, reasoning).
    input: StrictStr | list[Any] | None = None
    instructions: StrictStr | None = None
    max_output_tokens: TokenCount | None = None
    temperature: StrictFloat | None = None  # range checked as chat's (the chat request carries it)
    top_p: StrictFloat | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool = True  # OpenAI's default; kept only when the router's store is on
    previous_response_id: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None
    include: Annotated[list[StrictStr], Field(max_length=16)] | None = None
    truncation: Literal["disabled"] | None = Field(
        default=None, description='"auto" (dropping the oldest items) is not supported: 400')
    metadata: dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]] | None = None
    user: StrictStr | None = None  # accepted and echoed, used nowhere (as `user` in chat)
    safety_identifier: StrictStr | None = None  # the same
    # OpenAI's hint for its cache routing: the router already routes on the prompt's prefix.
    prompt_cache_key: StrictStr | None = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None

    @field_validator(*REFUSED, mode="after")
    @classmethod
    def _refused(cls, v: Any, info: Any) -> Any:
        return unsupported.check(REFUSED, info.field_name, v)

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[Any] | None) -> str | list[Any] | None:
        if isinstance(v, list):
            if not v:
                raise ValueError("must be a text or a list of at least one item")
            if len(v) > MAX_INPUT_ITEMS:
                raise ValueError(f"at most {MAX_INPUT_ITEMS} items")
            bad = next((i for i, item in enumerate(v) if not isinstance(item, dict)), None)
            if bad is not None:
                raise ValueError(f"item {bad} is not an object: items are messages "
                                 f"({{\"role\", \"content\"}}), function_call, function_call_output "
                                 f"or reasoning objects")
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        for item in v or []:
            if item not in INCLUDABLE:
                raise ValueError(f"{item!r:.80} cannot be included by this server (it can include "
                                 f"{', '.join(INCLUDABLE)})")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > MAX_METADATA or any(len(k) > 64 for k in v)):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys of at most 64 characters")
        return v

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries logprobs (include message.output_text.logprobs)."""
        return "message.output_text.logprobs" in (self.include or [])
