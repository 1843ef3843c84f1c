"""A request's preparation: its raw body parsed and validated, its prompts rendered and tokenized,
its constraint checked, its sampling parameters made: everything the router does with a request
before it dispatches, in one synchronous call (no awaits), so it runs on the event loop for a small
body and in the tokenizer pool for a large one (HotPath decides by the body's size: every byte
counts). A large body's shape is checked before it is parsed (api/body_shape.py).

    prepared = prepare_chat(gen, raw, large=False)     # or prepare_completion; OpenAIError 4xx
    await execute(prepared, gen)                       # admission, dispatch, the response
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import TypeVar

import pydantic

from engine.sampling_params import SamplingParams
from services.router.api.body_shape import ShapeLimits, check_shape
from services.router.api.chat_options import echo_text, reply_role, template_options
from services.router.api.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.api.prompt_render import echo_chars
from services.router.api.reasoning import reasoning_plan
from services.router.api.structured import requested
from services.router.api.tools import constrain, tool_plan
from services.router.api.unsupported import log_ignored
from services.router.errors import OpenAIError
from services.router.fanout import RunOptions
from services.router.generation import Generator
from services.router.http.errors_http import validation_error
from services.router.http.render import Reply
from services.router.http.tenants import request_salt

_Body = TypeVar("_Body", bound=pydantic.BaseModel)


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: its reply's shape, its prompts' ids and what its samples share."""

    reply: Reply
    prompts: list[list[int]]
    options: RunOptions
    stream: bool
    score_only: bool = False  # echo with max_tokens 0: the prompt back, its one generated token dropped


def parse(model: type[_Body], raw: bytes, limits: ShapeLimits | None) -> _Body:
    """`raw` validated as `model`, as FastAPI would (its JSON as `json.loads` reads it: pydantic's
    own parser, ~30% faster, first, and json.loads for what only it takes, such as the escape of
    a lone surrogate, which the tokenizer then refuses naming the field); with `limits` (a large
    body) its shape is checked first. A 400 naming the field."""
    if limits is not None:
        check_shape(raw, limits)
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        if e.errors()[0].get("type") != "json_invalid":
            raise validation_error(list(e.errors()), skip=0) from e  # type: ignore[arg-type]
    except RecursionError as e:
        raise OpenAIError(400, f"malformed JSON body: {e}"[:300]) from e
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"malformed JSON body: {e}"[:300]) from e
    field = _invalid_text_field(body)
    if field is not None:  # only json.loads takes these: text no tokenizer, salt or header can hold
        raise OpenAIError(400, f"{field}: not valid Unicode text (the escape of a lone surrogate)", field)
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(list(e.errors()), skip=0) from e  # type: ignore[arg-type]


def check_model(gen: Generator, model: str) -> None:
    """A 404 naming `model` unless it is the served one (400 for text that is not Unicode: the
    JSON escape of a lone surrogate)."""
    if not _is_text(model):
        raise OpenAIError(400, f"model: not valid Unicode text (a lone surrogate): {model!r}", "model")
    if model != gen.config.model:
        raise OpenAIError(404, f"the model {model!r} does not exist", "model", "model_not_found")


def _invalid_text_field(body: object) -> str | None:
    """The top-level field of a decoded JSON body holding a string (or key) with a lone
    surrogate, None when there is none."""
    if not isinstance(body, dict):
        return None
    for name, value in body.items():
        stack = [name, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str) and not _is_text(item):
                return str(name) if _is_text(str(name)) else "body"
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def prepare_completion(gen: Generator, raw: bytes, large: bool) -> Prepared:
    body = parse(CompletionRequest, raw, gen.shape_limits if large else None)
    check_model(gen, body.model)
    log_ignored("completions", body.model_extra)
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    score_only = max_tokens == 0
    if score_only and not body.echo:
        raise OpenAIError(400, "max_tokens: 0 generates nothing: it needs echo=true (the prompt back, "
                               "with its logprobs when logprobs is set); else at least 1", "max_tokens")
    if score_only and body.best_of not in (None, 1):
        raise OpenAIError(400, "best_of: there is nothing to rank with max_tokens 0", "best_of")
    max_tokens = max(max_tokens, 1)  # the engine computes one token, which is not returned
    keep = gen.truncation(body.truncate_prompt_tokens, max_tokens)
    prompts = [gen.check_token_ids(p, "prompt", keep) if isinstance(p, list)
               else gen.tokenize(p, "prompt", truncate=keep) for p in body.prompts]
    lens = tuple(len(ids) for ids in prompts)
    fields = body.sampling_kwargs()
    if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs too
        fields["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
    fields["structured_outputs"] = gen.constrain(requested(body))
    params = gen.params(max(lens), max_tokens, fields, body.logprobs)
    echo = _echo_texts(gen, body, prompts) if body.echo else ()
    reply = Reply(gen, body.model, f"cmpl-{uuid.uuid4().hex}", lens, body.n, False,
                  body.include_usage, body.continuous_usage, echo_prompts=echo,
                  echo_offsets=tuple(echo_chars(gen.thread_tokenizer, p) for p in prompts) if echo else (),
                  prompts=tuple(prompts), logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    return Prepared(reply, prompts, _options(body, params, body.best_of), body.stream, score_only)


def prepare_chat(gen: Generator, raw: bytes, large: bool) -> Prepared:
    body = parse(ChatCompletionRequest, raw, gen.shape_limits if large else None)
    check_model(gen, body.model)
    log_ignored("chat.completions", body.model_extra)
    return prepare_chat_body(gen, body)


def prepare_chat_body(gen: Generator, body: ChatCompletionRequest) -> Prepared:
    """A parsed chat request (its model checked) ready to run (the Responses API's too)."""
    config = gen.config
    tools = tool_plan(body, config.auto_tools,
                      lambda spec: gen.backends.choose(spec, config.structured_outputs_backend),
                      config.tool_call_parser or "hermes")
    template = replace(template_options(body, body.messages, gen.tokenizer), tools=tools.template_tools)
    keep = gen.truncation(body.truncate_prompt_tokens, body.token_limit)
    ids = gen.tokenize([m.as_template_dict() for m in body.messages], "messages", template, keep)
    top = (body.top_logprobs or 0) if body.logprobs else None
    fields = {**body.sampling_kwargs(), "structured_outputs": gen.constrain(requested(body))}
    constrain(fields, tools)  # tool_choice required / named: its grammar, or a 400 beside another
    params = gen.params(len(ids), body.token_limit, fields, top)
    reasoning = reasoning_plan(config.reasoning_parser, gen.thread_tokenizer, ids, body.include_reasoning,
                               constrained=fields.get("structured_outputs") is not None)
    reply = Reply(gen, body.model, f"chatcmpl-{uuid.uuid4().hex}", (len(ids),), body.n, True,
                  body.include_usage, body.continuous_usage, role=reply_role(body, body.messages),
                  echo=echo_text(body, body.messages, body.echo), prompt_logprobs=body.prompt_logprobs,
                  tools=replace(tools, template_tools=()) if tools.parses else None, reasoning=reasoning)
    options = _options(body, params)
    if tools.keeps_special_tokens:  # the parser's tag is a special token (as vLLM's mistral parser)
        options = replace(options, skip_special_tokens=False)
    return Prepared(reply, [ids], options, body.stream)


def _echo_texts(gen: Generator, body: CompletionRequest, prompts: list[list[int]]) -> tuple[str, ...]:
    """What each choice of an echoing completion starts with: its prompt as sent (the text of its
    token ids for an id prompt, or once truncate_prompt_tokens cut it)."""
    texts = []
    for sent, ids in zip(body.prompts, prompts, strict=True):
        whole = isinstance(sent, str) and body.truncate_prompt_tokens is None
        texts.append(sent if isinstance(sent, str) and whole else gen.detokenize(ids))
    return tuple(texts)


def _options(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
             best_of: int | None = None) -> RunOptions:
    return RunOptions(params, body.n, best_of, tuple(body.stop_strings), body.include_stop_str_in_output,
                      body.skip_special_tokens, body.spaces_between_special_tokens, body.priority,
                      request_salt(body.cache_salt))
