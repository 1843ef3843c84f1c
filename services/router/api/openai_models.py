"""OpenAI request bodies (pydantic, validated at the edge) and the response / chunk bodies.

Validation errors name the field; the app turns them into 400 OpenAI error bodies. Fields of
the OpenAI / vLLM APIs that are not implemented yet are refused with a 400 naming them
(services/router/api/unsupported.py); fields neither API defines are ignored with a debug log line.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from services import limits
from services.router.api import unsupported
from services.router.api.structured_fields import StructuredFields
from services.router.api.tool_fields import MAX_TOOLS, ToolCall, ToolFields

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = limits.MAX_STOP
MAX_PROMPTS = 256  # a batch's prompts: each runs n (or best_of) samples


def _json_integer(v: object) -> int:
    """JSON Schema's integer: an int or an integral number like 2.0, not 2.5, a bool or a string."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    raise ValueError(f"must be an integer, got {v!r:.40}")


# Integers with their bounds; the bounds come before the validator, or the OpenAPI schema loses them.
TokenCount = Annotated[int, Field(ge=1), BeforeValidator(_json_integer)]
SampleCount = Annotated[int, Field(ge=1, le=16), BeforeValidator(_json_integer)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), BeforeValidator(_json_integer)]  # workers: int64
TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_json_integer)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), BeforeValidator(_json_integer)]
MAX_LIST_FIELD = limits.MAX_LIST_FIELD  # logit_bias entries, allowed_token_ids


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, usage in every chunk


if TYPE_CHECKING:
    _CompletionRefused = BaseModel
    _ChatRefused = BaseModel
else:
    _CompletionRefused = unsupported.fields_model("_CompletionRefused", unsupported.COMPLETION)
    _ChatRefused = unsupported.fields_model("_ChatRefused", unsupported.CHAT)


class _SamplingFields(StructuredFields):
    model_config = ConfigDict(extra="allow")  # kept in model_extra for the debug line, then ignored

    model: StrictStr
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, used and logged nowhere
    max_tokens: TokenCount | None = None
    # strict: ints, not strings or bools
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=limits.MAX_TEMPERATURE)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    n: SampleCount = 1  # before seed: its check needs n
    seed: Seed | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM's: the stop string stays in the text
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties, and vLLM's extra sampling parameters under vLLM's names.
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=limits.MAX_REPETITION_PENALTY)
    # -1 or 0: off
    top_k: Annotated[int, Field(ge=-1, le=limits.MAX_TOP_K), BeforeValidator(_json_integer)] = -1
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000), BeforeValidator(_json_integer)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    # OpenAI's: token id (as a string) -> bias in [-100, 100], added to the logits.
    logit_bias: Annotated[dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LIST_FIELD)] | None = None
    # vLLM's: sampling only among these ids; bad_words banned (each word, with and without a
    # leading space, as vLLM tokenizes them); the workers' scheduling priority (lower first).
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST_FIELD)] | None = None
    bad_words: Annotated[list[Annotated[StrictStr,
                                        Field(min_length=1, max_length=limits.MAX_BAD_WORD_TOKENS)]],
                         Field(max_length=MAX_STOP_STRINGS)] | None = None
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX), BeforeValidator(_json_integer)] = 0
    # vLLM's: KV (prefix cache, KV store) is shared only among requests of the same salt; the
    # router combines it with the caller's tenant salt (--tenant-cache-salt).
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=limits.MAX_CACHE_SALT)] | None = None
    # vLLM's: each prompt token's logprob and the top-N there (not with stream for N > 0, as vLLM)
    prompt_logprobs: TopLogprobs | None = None
    # vLLM's detokenization options, applied where the router turns token ids into text.
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True  # the tokenizer's: the `tokenizers` backend ignores it
    # vLLM's: keep the prompt's last k tokens (-1: as many as fit with the output tokens asked for).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX),
                                      BeforeValidator(_json_integer)] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The engine SamplingParams fields this request sets (max_tokens and logprobs aside;
        `bad_words` as words, which the generator tokenizes)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "top_k": self.top_k or -1,
                "min_p": self.min_p, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                "stop_token_ids": list(self.stop_token_ids or []),
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()} or None,
                "allowed_token_ids": self.allowed_token_ids,  # [] is an error, as in vLLM
                "bad_words": self.bad_words or None, "prompt_logprobs": self.prompt_logprobs}

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream=true (as in vLLM)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k in v or {}:
            if not k.isascii() or not k.isdigit() or int(k) > INT32_MAX:
                raise ValueError(f"keys must be token ids written as strings, got {k!r:.40}")
        return v

    @field_validator("seed")
    @classmethod
    def _seeds_fit(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v + n - 1 > INT64_MAX:  # sample i uses seed + i
            raise ValueError(f"seed + n - 1 must be at most {INT64_MAX} (sample i runs with seed + i)")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 (as many as fit), got 0")
        return v

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


TextPrompt = Annotated[StrictStr, Field(min_length=1)]
TokenIdsPrompt = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields, _CompletionRefused):
    # One prompt (text or token ids) or a batch of them (vLLM's: choice k * n + i is sample i of prompt k).
    prompt: (TextPrompt | TokenIdsPrompt
             | Annotated[list[TextPrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIdsPrompt], Field(min_length=1, max_length=MAX_PROMPTS)])
    # 0 with echo scores the prompt: its text (and logprobs) back, nothing generated (OpenAI's and
    # vLLM's); without echo a 400 (services/router/prepare.py).
    max_tokens: Annotated[int, Field(ge=0), BeforeValidator(_json_integer)] | None = None
    logprobs: TopLogprobs | None = None
    echo: StrictBool = False  # each choice starts with its prompt (with logprobs: the prompt's too)
    best_of: SampleCount | None = None  # after n, seed and stream: its checks need them

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts; one prompt is a batch of one (a list of ints is one prompt)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n, seed = info.data.get("n", 1), info.data.get("seed")
        if v is None:
            return v
        if v < n:
            raise ValueError(f"must be at least n={n}, got {v}")
        if v > n and info.data.get("stream"):
            raise ValueError("cannot be used with stream (the best samples are known once all have ended)")
        if seed is not None and seed + v - 1 > INT64_MAX:
            raise ValueError(f"seed + best_of - 1 must be at most {INT64_MAX} (sample i runs with seed + i)")
        return v

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _text_or_token_ids(cls, v: object, handler: ValidatorFunctionWrapHandler) -> object:
        """A valid prompt is checked by pydantic alone (token ids in Rust, not per id in Python);
        an invalid one gets an error naming what is wrong before the union's per-member errors."""
        if isinstance(v, str | list) and v:
            try:
                return handler(v)
            except ValidationError:
                pass  # JSON integers written as 2.0, or a real error: named below
        if isinstance(v, str | list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(p, str | list) for p in v):
            return handler(_batch(v))
        if isinstance(v, list):
            return handler(_checked_ids(v))
        if not isinstance(v, str):
            raise ValueError(f"must be a string, a list of token ids, or a batch of either, got "
                             f"{type(v).__name__}")
        return handler(v)


def _batch(v: list[object]) -> list[str] | list[list[int]]:
    """A batch of prompts, all texts or all token-id lists, or a ValueError naming what is wrong."""
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(v)}")
    if all(isinstance(p, str) for p in v):
        if not all(v):
            raise ValueError(f"prompt {[bool(p) for p in v].index(False)} of the batch is empty")
        return v  # type: ignore[return-value]
    if not all(isinstance(p, list) for p in v):
        raise ValueError("a batch of prompts must be all strings or all lists of token ids")
    out = []
    for k, p in enumerate(v):
        try:
            out.append(_checked_ids(p))  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"prompt {k} of the batch: {e}") from None
    return out


def _checked_ids(v: list[object]) -> list[int]:
    if not v:
        raise ValueError("prompt must not be empty")
    ids = _token_ids(v)
    if min(ids) < 0:
        raise ValueError(f"token ids must not be negative, got {min(ids)}")
    return ids


def _token_ids(v: list[object]) -> list[int]:
    """Each item as a JSON integer, or a ValueError naming the first one that is not."""
    ids = []
    for i, t in enumerate(v):
        try:
            ids.append(_json_integer(t))
        except ValueError as e:
            raise ValueError(f"token id {i}: {e}") from None
    return ids


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None  # the author's name; a tool message's function
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # the assistant's
    # The call a tool message answers: required for role "tool" (validate_default: checked when absent).
    tool_call_id: StrictStr | None = Field(default=None, validate_default=True)
    # An assistant turn's reasoning, as a reasoning parser returned it (vLLM's `reasoning`, and its
    # older name): the template gets it as both (Qwen3's renders `reasoning_content` in tool loops).
    reasoning: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError(f"only assistant messages make tool calls, not a {info.data.get('role')!r} one")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise ValueError("a tool message must say which call it answers")
        return v

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (vLLM's and transformers' form): calls'
        arguments as JSON values, not text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments or "{}")}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role == "assistant":
            out["reasoning"] = out["reasoning_content"] = reasoning
        return out


class ChatTemplateFields(BaseModel):
    """vLLM's chat template options (checked against each other and the messages in chat_options.py)."""

    add_generation_prompt: StrictBool = True  # end with the assistant's header
    continue_final_message: StrictBool = False  # leave the last (assistant) message open: no end of turn
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields, ToolFields, _ChatRefused):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    echo: StrictBool = False  # vLLM's: the reply starts with the last message when it has the reply's role
    include_reasoning: StrictBool = True  # vLLM's: false drops the reasoning part (--reasoning-parser)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


# One server-sent event (Open API 3.1 describes a stream by its events): a JSON chunk, or `[DONE]`.
_SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk body, or [DONE] last"}},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}


# OpenAPI documentation of the routes' other replies, for their decorators' `responses=`: the event
# stream of `"stream": true` and the OpenAI error bodies (401 only with an API key set).
OPENAI_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}}},
    400: _error("Invalid request: the error's `param` names the field"),
    401: _error("Missing or wrong API key"),
    404: _error("Unknown model"),
    429: _error("Too many requests in flight or queued; retry after `Retry-After` seconds"),
    503: _error("No healthy worker could take the request"),
    504: _error("A worker timed out"),
}
MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {401: OPENAI_RESPONSES[401]}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: {"description": "No healthy decode worker"}}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(request_id: str, model: str, choices: list[dict[str, Any]],
                    usage: dict[str, Any] | None, chunk: bool = False, chat: bool = False) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    body: dict[str, Any] = {"id": request_id, "object": f"{kind}.chunk" if chunk and chat else kind,
                            "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None or chunk:
        body["usage"] = usage
    return body


def models_body(model: str, max_model_len: int, created: int, root: str | None = None) -> dict[str, Any]:
    """`/v1/models` as vLLM answers it: one model card with the context limit requests get."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "pdserve",
            "root": root or model, "parent": None, "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


class WorkerChange(BaseModel):
    """A worker registration change through the router's admin API."""

    role: Literal["prefill", "decode", "colocated"]
    # The form only (drain / remove name a worker the router knows); POST /admin/workers checks
    # the host, the port's range and that the target answers (services/router/http/admin.py).
    target: Annotated[StrictStr, Field(min_length=3, max_length=255,
                                       pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}$")]
    force: StrictBool = False
