"""The OpenAI routes: `/v1/completions`, `/v1/chat/completions` (through HotPath: the raw body to
`prepare`, then dispatch) and `/v1/models`.

A body of at most `inline_bytes` is prepared on the event loop (~1 ms); a larger one in the
tokenizer pool, its shape checked before it is parsed (prepare.py), so no request holds the loop
while its JSON is parsed, its template rendered or its prompt tokenized; a caller gets at most
`max_pooled_per_caller` such preparations under way at once, `max_heavy_per_caller` of bodies
over `heavy_bytes` (http/heavy.py).
The FastAPI routes of the two hot paths exist for the API schema: HotPath answers every POST
there itself.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from services import tracing
from services.router.api.openai_models import (
    MODELS_RESPONSES,
    OPENAI_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    models_body,
)
from services.router.errors import OpenAIError
from services.router.fanout import Delta
from services.router.generation import Generator
from services.router.http.heavy import PoolLimits
from services.router.http.hot_path import Handler
from services.router.http.render import respond
from services.router.http.tenants import caller
from services.router.prepare import Prepared, check_model, prepare_chat, prepare_completion

Prepare = Callable[[Generator, bytes, bool], Prepared]


async def execute(prepared: Prepared) -> JSONResponse | StreamingResponse:
    """Admission, then the samples dispatched and the response written."""
    reply = prepared.reply
    gen = reply.gen
    with tracing.span("admission"):
        admission = gen.admit()
    gen.metrics.prompt_tokens.inc(sum(reply.prompt_lens))
    deltas = gen.run(reply.request_id, prepared.prompts, prepared.options)
    if prepared.score_only:
        deltas = _prompt_only(deltas)
    return await respond(reply, deltas, prepared.stream, admission)


async def _prompt_only(deltas: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
    """echo with max_tokens 0: each sample's deltas without what it generated (the one token the
    engine computed to get the prompt's logprobs); it ends as OpenAI's does, with "length"."""
    async with aclosing(deltas):
        async for d in deltas:
            yield replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0,
                          finish_reason="length" if d.finish_reason else None)


def openai_routes(gen: Callable[[], Generator], limits: Callable[[], PoolLimits]
                  ) -> tuple[APIRouter, dict[str, Handler]]:
    """The routes, and HotPath's handlers of the two generation endpoints."""
    router = APIRouter()

    async def run(prepare: Prepare, raw: bytes, scope: Scope | None) -> Response:
        g = gen()
        try:
            with tracing.span("tokenization") as span:  # (the body parsed, the prompt rendered too)
                if len(raw) <= g.config.inline_bytes:
                    prepared = prepare(g, raw, False)
                else:
                    with limits().slot(caller(scope) if scope is not None else "", len(raw)):
                        prepared = await g.in_pool(prepare, g, raw, True)
                if span is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", sum(prepared.reply.prompt_lens))
            return await execute(prepared)
        except OpenAIError as e:
            return e.response()

    created = int(time.time())  # when this router started serving the model

    def body() -> dict[str, Any]:
        g = gen()
        return models_body(g.config.model, g.max_model_len, created, g.config.tokenizer)

    @router.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        return body()

    @router.get("/v1/models/{model_id:path}", responses=MODELS_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        check_model(gen(), model_id)
        card: dict[str, Any] = body()["data"][0]
        return card

    @router.post("/v1/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def completions(body: CompletionRequest) -> Response:
        return await run(prepare_completion, body.model_dump_json(exclude_unset=True).encode(), None)

    @router.post("/v1/chat/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def chat(body: ChatCompletionRequest) -> Response:
        return await run(prepare_chat, body.model_dump_json(exclude_unset=True).encode(), None)

    def handler(prepare: Prepare) -> Handler:
        def handle(raw: bytes, scope: Scope) -> Awaitable[Response]:
            return run(prepare, raw, scope)
        return handle

    return router, {"/v1/completions": handler(prepare_completion),
                    "/v1/chat/completions": handler(prepare_chat)}
