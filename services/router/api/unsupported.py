"""Request fields of the OpenAI and vLLM APIs that pdserve does not implement yet.

A request that uses one gets a 400 in OpenAI's error format whose `param` names the field, never
a 200 that silently ignores it (a client banning a token with `logit_bias` must not get it back
unbanned). A field sent with its no-op value (`"best_of": 1`, `"function_call": "none"`, ...)
asks for nothing the server does not do and is accepted. Fields outside both APIs' request
schemas are ignored, as vLLM does, with a debug log line (`log_ignored`).

When a field is implemented, it leaves these tables and becomes a typed field of the request
model in openai_models.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, create_model, field_validator

log = logging.getLogger(__name__)

NoOp = Callable[[Any], bool]


def _absent(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, list | dict | str) and len(v) == 0)


def _false(v: Any) -> bool:
    return v is None or v is False


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 1)


def _no_tool_choice(v: Any) -> bool:
    return v is None or v in ("none", "auto")  # "auto" with no functions chooses none


def _text_modality(v: Any) -> bool:
    return v is None or v == ["text"]


# Field -> (its no-op test, what a client would expect it to do).
_SAMPLING: dict[str, tuple[NoOp, str]] = {
    "use_beam_search": (_false, "runs beam search"),
    "length_penalty": (_one, "weighs beam-search lengths"),
    "logits_processors": (_empty, "runs custom logits processors"),
    "return_tokens_as_token_ids": (_false, "returns tokens as token ids"),
    "kv_transfer_params": (_absent, "takes part in an external KV transfer"),
    "vllm_xargs": (_empty, "passes extra arguments to custom extensions"),
}

COMPLETION: dict[str, tuple[NoOp, str]] = {
    **_SAMPLING,
    "suffix": (_empty, "inserts a completion before a suffix"),
}

CHAT: dict[str, tuple[NoOp, str]] = {
    **_SAMPLING,
    "best_of": (_one, "samples best_of and returns the n best"),  # vLLM's chat has no best_of either
    # OpenAI's deprecated forms of tools / tool_choice: send those instead.
    "functions": (_empty, "offers functions (deprecated function calling: use tools)"),
    "function_call": (_no_tool_choice, "asks for a function call (deprecated: use tool_choice)"),
    "chat_template": (_absent, "replaces the model's chat template"),
    "documents": (_empty, "passes documents to the chat template"),
    "mm_processor_kwargs": (_empty, "passes arguments to a multimodal processor"),
    "modalities": (_text_modality, "asks for audio output"),
    "audio": (_absent, "asks for audio output"),
    "prediction": (_absent, "uses predicted outputs"),
    "web_search_options": (_absent, "searches the web"),
}


def fields_model(name: str, table: Mapping[str, tuple[NoOp, str]]) -> type[BaseModel]:
    """A model with one optional field per entry of `table` (so the OpenAPI schema lists them),
    each refused unless its value is the no-op; request models inherit it."""
    def refuse(cls: type[BaseModel], v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return check(table, info.field_name, v)

    fields: dict[str, Any] = {
        field: (Any, Field(default=None, description=f"not supported yet: 400 unless it asks for "
                                                     f"nothing (it {what})"))
        for field, (_, what) in table.items()}
    validators: dict[str, Any] = {"refuse": field_validator(*table, mode="after")(classmethod(refuse))}
    model: type[BaseModel] = create_model(name, __validators__=validators, **fields)
    return model


def check(table: Mapping[str, tuple[NoOp, str]], name: str, value: Any) -> Any:
    """`value` when it is `name`'s no-op; else a ValueError saying the field is not supported."""
    no_op, what = table[name]
    if not no_op(value):
        raise ValueError(f"not supported by this server yet (it {what}); leave {name} out")
    return value


def log_ignored(endpoint: str, extra: Mapping[str, Any] | None) -> None:
    """A debug line naming the fields of a request that neither API defines (ignored, as vLLM)."""
    if extra and log.isEnabledFor(logging.DEBUG):
        log.debug("%s: ignored unknown fields %s", endpoint, sorted(extra)[:20])

