"""What a chat request's vLLM fields ask of its prompt and its reply, checked before any template
runs (each error a 400 naming the field):

    template = template_options(body, tokenizer)   # add_generation_prompt, continue_final_message,
    text = processor.apply_chat_template(messages, **template.as_kwargs())  # chat_template_kwargs
    role, echo = reply_role(body), echo_text(body)  # vLLM's reply role and `echo`

As in vLLM: `continue_final_message` leaves the last message open (transformers' rendering: the
template's text cut right after that message's content) and needs `add_generation_prompt` false;
the reply's role is the assistant's, or the last message's without a generation prompt; `echo`
puts the last message's content before each choice's when that message has the reply's role.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.router.api.openai_models import ChatMessage, ChatTemplateFields
from services.router.errors import OpenAIError

# Template variables a request may not set through chat_template_kwargs: the request's own fields
# set them, or they are apply_chat_template's arguments rather than template variables (along with
# every other named parameter of the tokenizer's apply_chat_template).
_RESERVED = frozenset({"messages", "conversation", "add_generation_prompt", "continue_final_message",
                       "tokenize", "chat_template", "tools", "documents", "return_dict"})


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)
    tools: tuple[dict[str, Any], ...] = ()  # the request's tools (the template's `tools`), as sent

    def as_kwargs(self) -> dict[str, Any]:
        """Processor.apply_chat_template's keyword arguments."""
        tools = {"tools": list(self.tools)} if self.tools else {}
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": {**self.variables, **tools}}


def template_options(fields: ChatTemplateFields, messages: list[ChatMessage], tokenizer: Any
                     ) -> TemplateOptions:
    """The request's template options, or a 400 naming the field that cannot be honoured."""
    if fields.continue_final_message and fields.add_generation_prompt:
        raise OpenAIError(400, "continue_final_message: cannot be used with add_generation_prompt "
                               "(true unless set to false): set add_generation_prompt to false",
                          "continue_final_message")
    if fields.continue_final_message and messages[-1].role != "assistant":
        raise OpenAIError(400, f"continue_final_message: the last message must be the assistant's, "
                               f"got a {messages[-1].role!r} message", "continue_final_message")
    variables = fields.chat_template_kwargs or {}
    taken = sorted(set(variables) & (_RESERVED | _parameters(type(tokenizer))))
    if taken:
        raise OpenAIError(400, f"chat_template_kwargs: {', '.join(taken)} cannot be set here (the "
                               f"request's own fields or the server set them)", "chat_template_kwargs")
    return TemplateOptions(fields.add_generation_prompt, fields.continue_final_message, variables)


def reply_role(fields: ChatTemplateFields, messages: list[ChatMessage]) -> str:
    """The role of the reply's messages: the assistant's after a generation prompt, else the last
    message's (the reply continues it)."""
    return "assistant" if fields.add_generation_prompt else messages[-1].role


def echo_text(fields: ChatTemplateFields, messages: list[ChatMessage], echo: bool) -> str:
    """With `echo`, the last message's content when it has the reply's role (else nothing): each
    choice's content starts with it."""
    last = messages[-1]
    if not echo or last.role != reply_role(fields, messages):
        return ""
    content: str = last.as_template_dict()["content"]
    return content


def _parameters(tokenizer_class: type) -> frozenset[str]:
    """The named parameters of a tokenizer class's apply_chat_template (none without one)."""
    if tokenizer_class not in _PARAMETERS:
        method = getattr(tokenizer_class, "apply_chat_template", None)
        kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        _PARAMETERS[tokenizer_class] = frozenset(
            name for name, p in (inspect.signature(method).parameters.items() if method else ())
            if p.kind not in kinds and name != "self")
    return _PARAMETERS[tokenizer_class]


_PARAMETERS: dict[type, frozenset[str]] = {}
