"""vLLM's tokenizer endpoints on the router (the same tokenizer and chat template as generation):

    POST /tokenize     {"prompt": text, "add_special_tokens": true}
                       or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                           "continue_final_message": false, "chat_template_kwargs": {...}, "tools": [...]}
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [ids]} -> {"prompt": text}

With their defaults the tokens are exactly what a completion or a chat request would prefill.
`model` is optional; another model than the served one is a 404. Bad input is a 400 naming the
field, as on /v1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from services.router.api.body_shape import ShapeLimits, check_shape
from services.router.api.chat_options import template_options
from services.router.api.openai_models import OPENAI_RESPONSES, ChatMessage, ChatTemplateFields, _json_integer
from services.router.api.tool_fields import MAX_TOOLS, Tool
from services.router.api.tools import as_template_tools
from services.router.config import RouterConfig
from services.router.errors import OpenAIError, field_path
from services.router.generation import Generator
from services.router.http.heavy import PoolLimits
from services.router.http.tenants import caller
from services.router.prepare import check_model as served_model


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    return_token_strs: StrictBool = False


class TokenizeText(_Tokenize):
    prompt: Annotated[StrictStr, Field(min_length=1)]
    add_special_tokens: StrictBool = True  # as a completion's prompt


class TokenizeChat(_Tokenize, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # the template lists them
    add_special_tokens: StrictBool = False  # the chat template writes them, as for a chat request


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[int, Field(ge=0), BeforeValidator(_json_integer)]]  # 2.0 is a JSON integer


def _loads(raw: bytes, limits: ShapeLimits | None) -> Any:
    """The JSON of a body (a large one's shape checked first), or a 400."""
    if limits is not None:
        check_shape(raw, limits)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"malformed JSON body: {e}"[:300]) from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    """`body` as `model`, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = field_path(first["loc"]) or None
        raise OpenAIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body the route parses itself: any of `models` (their nested models are the
    app's components, which the chat route already puts there)."""
    schemas = []
    for m in models:
        schema = m.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)
        schemas.append(schema)
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


_ERRORS: dict[int | str, dict[str, Any]] = {400: OPENAI_RESPONSES[400], 401: OPENAI_RESPONSES[401],
                                            404: OPENAI_RESPONSES[404]}


def tokens_router(config: RouterConfig, gen: Callable[[], Generator],
                  limits: Callable[[], PoolLimits]) -> APIRouter:
    router = APIRouter()

    async def read(request: Request, *models: type[BaseModel]) -> Any:
        """The body as one of `models` (the first for a chat, by its `messages`): parsed on the
        event loop when small, in the tokenizer pool when large (as /v1's, prepare.py)."""
        def load(raw: bytes, large: bool) -> Any:
            body = _loads(raw, gen().shape_limits if large else None)
            chat = isinstance(body, dict) and "messages" in body
            return _parse(models[0] if chat or len(models) == 1 else models[1], body)

        raw = await request.body()
        g = gen()
        if len(raw) <= g.config.inline_bytes:
            return load(raw, False)
        with limits().slot(caller(request.scope), len(raw)):
            return await g.in_pool(load, raw, True)

    def check_model(model: str | None) -> None:
        if model is not None:
            served_model(gen(), model)

    @router.post("/tokenize", responses=_ERRORS, openapi_extra=_body_schema(TokenizeText, TokenizeChat))
    async def tokenize(request: Request) -> dict[str, Any]:
        """A text's or a chat's token ids, as generation would prefill them."""
        req = await read(request, TokenizeChat, TokenizeText)
        check_model(req.model)
        g = gen()
        if isinstance(req, TokenizeChat):
            template = replace(template_options(req, req.messages, g.tokenizer),
                               tools=as_template_tools(req.tools))
            ids = await g.encode([m.as_template_dict() for m in req.messages], "messages",
                                 req.add_special_tokens, template)
        else:
            ids = await g.encode(req.prompt, "prompt", req.add_special_tokens)
        strs = (await g.decode(ids, "tokens"))[1] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": g.max_model_len, "tokens": ids, "token_strs": strs}

    @router.post("/detokenize", responses=_ERRORS, openapi_extra=_body_schema(Detokenize))
    async def detokenize(request: Request) -> dict[str, Any]:
        """The text of token ids (special tokens kept)."""
        req = await read(request, Detokenize)
        check_model(req.model)
        text, _ = await gen().decode(req.tokens, "tokens")
        return {"prompt": text}

    return router
