"""`POST /v1/responses` (through HotPath, as the chat and completions endpoints: a large body is
prepared in the tokenizer pool), `GET` and `DELETE /v1/responses/{id}`.

A Responses request runs as the chat request convert.py makes of it: the same admission,
dispatch (prefill -> decode, or colocated), parsers and metrics. Errors before its first token are
HTTP statuses, as on chat; a failure after a stream started is a `response.failed` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import pydantic
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.types import Scope

from services.router.api.openai_models import OPENAI_RESPONSES, ChatCompletionRequest
from services.router.api.unsupported import log_ignored
from services.router.dispatch.dispatcher import NoWorkerError
from services.router.errors import OpenAIError, from_dispatch
from services.router.fanout import Delta
from services.router.generation import Admission, Generator
from services.router.http.heavy import PoolLimits
from services.router.http.hot_path import Handler, SSEResponse
from services.router.http.render import first_delta
from services.router.http.tenants import caller, current_tenant
from services.router.prepare import Prepared, check_model, parse, prepare_chat_body
from services.router.responses.convert import PASSED, chat_body, input_items, renamed, validation_error
from services.router.responses.output import Event, OutputBuilder, Shape
from services.router.responses.request import ResponsesRequest
from services.router.responses.store import ResponseStore, Stored
from services.worker.client import WorkerError

NO_STORE = ("this server keeps no responses: start the router with --enable-responses-store "
            "(pdserve up --enable-responses-store)")


@dataclass(frozen=True)
class PreparedResponse:
    chat: Prepared  # the chat request it runs as (its reply's request_id is the response's id)
    request: ResponsesRequest
    messages: list[dict[str, Any]]  # the conversation before the output (for the store)
    tenant: str


def prepare_response(gen: Generator, store: ResponseStore | None, raw: bytes, large: bool
                     ) -> PreparedResponse:
    """Parse, check and convert a Responses body; every error a 4xx naming the Responses field."""
    request = parse(ResponsesRequest, raw, gen.shape_limits if large else None)
    check_model(gen, request.model)
    extra = request.model_extra or {}
    log_ignored("responses", {k: v for k, v in extra.items() if k not in PASSED})
    tenant = current_tenant()
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        if store is None:
            raise OpenAIError(400, f"previous_response_id: {NO_STORE}", "previous_response_id")
        found = store.get(tenant, request.previous_response_id)
        if found is None:
            raise OpenAIError(400, f"previous_response_id: no stored response has the id "
                                   f"{request.previous_response_id!r:.140}", "previous_response_id",
                              "previous_response_not_found")
        history = found.messages
    body, names = chat_body(request, history)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(e, names) from None
    try:
        prepared = prepare_chat_body(gen, chat)
    except OpenAIError as e:
        raise renamed(e, names) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    prepared = replace(prepared, reply=replace(prepared.reply, request_id=response_id))
    conversation = [m for m, name in zip(body["messages"], names, strict=True) if name != "instructions"]
    return PreparedResponse(prepared, request, conversation, tenant)


async def execute(p: PreparedResponse, store: ResponseStore | None) -> Response:
    """Admission, the sample dispatched, the response (or its event stream) written."""
    reply = p.chat.reply
    gen = reply.gen
    admission = gen.admit()
    gen.metrics.prompt_tokens.inc(sum(reply.prompt_lens))
    build = OutputBuilder(Shape(reply.request_id, p.request, reply, p.request.store and store is not None))
    deltas = gen.run(reply.request_id, p.chat.prompts, p.chat.options)
    retry = gen.config.retry_after_s
    streaming = False
    try:
        first = await first_delta(deltas, retry)
        if p.request.stream:
            streaming = True
            return SSEResponse(_events(p, build, first, deltas, admission, store),
                               media_type="text/event-stream",
                               background=BackgroundTask(admission.release_async))
        try:
            async with aclosing(deltas):
                build.feed(first)
                async for delta in deltas:
                    build.feed(delta)
        except (WorkerError, NoWorkerError) as e:
            raise from_dispatch(e, retry) from e
        build.finish_events()
        _keep(p, build, store)
        return JSONResponse(build.body())
    finally:
        if not streaming:
            admission.release()


async def _events(p: PreparedResponse, build: OutputBuilder, first: Delta,
                  deltas: AsyncGenerator[Delta, None], admission: Admission,
                  store: ResponseStore | None) -> AsyncIterator[str]:
    try:
        yield _sse(build.start())
        try:
            async with aclosing(deltas):
                delta: Delta | None = first
                while delta is not None:
                    events = build.feed(delta)
                    if events:
                        yield _sse(events)
                    delta = await anext(deltas, None)
        except (WorkerError, NoWorkerError) as e:
            error = from_dispatch(e, p.chat.reply.gen.config.retry_after_s)
            yield _sse(build.fail(error.code or "server_error", error.message))
            return
        yield _sse(build.finish_events())
        _keep(p, build, store)
    finally:
        admission.release()


def _keep(p: PreparedResponse, build: OutputBuilder, store: ResponseStore | None) -> None:
    if store is not None and p.request.store:
        store.put(p.tenant, build.body(), p.messages + build.chat_messages(), input_items(p.request.input))


def _sse(events: list[Event]) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def responses_routes(gen: Callable[[], Generator], limits: Callable[[], PoolLimits],
                     store: Callable[[], ResponseStore | None]) -> tuple[APIRouter, dict[str, Handler]]:
    """The routes, and HotPath's handler of POST /v1/responses."""
    router = APIRouter()

    async def run(raw: bytes, scope: Scope | None) -> Response:
        g = gen()
        try:
            if len(raw) <= g.config.inline_bytes:
                prepared = prepare_response(g, store(), raw, False)
            else:
                with limits().slot(caller(scope) if scope is not None else "", len(raw)):
                    prepared = await g.in_pool(prepare_response, g, store(), raw, True)
            return await execute(prepared, store())
        except OpenAIError as e:
            return e.response()

    def stored(response_id: str) -> Stored:
        kept = store()
        if kept is None:
            raise OpenAIError(404, NO_STORE, "response_id", "not_found")
        found = kept.get(current_tenant(), response_id)
        if found is None:
            raise OpenAIError(404, f"no stored response has the id {response_id!r:.140}", "response_id",
                              "not_found")
        return found

    @router.post("/v1/responses", response_model=None, responses=OPENAI_RESPONSES)
    async def create(body: ResponsesRequest) -> Response:
        return await run(body.model_dump_json(exclude_unset=True, by_alias=True).encode(), None)

    @router.get("/v1/responses/{response_id}", responses={404: OPENAI_RESPONSES[400]})
    async def retrieve(response_id: str) -> dict[str, Any]:
        return stored(response_id).body

    @router.get("/v1/responses/{response_id}/input_items", responses={404: OPENAI_RESPONSES[400]})
    async def items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
        """A stored response's input items, as OpenAI pages them (newest first by default)."""
        listed = list(stored(response_id).items)
        if order == "desc":
            listed.reverse()
        if after is not None:
            at = next((i for i, item in enumerate(listed) if item["id"] == after), None)
            if at is None:
                raise OpenAIError(400, f"after: no input item of {response_id!r:.140} has the id "
                                       f"{after!r:.140}", "after")
            listed = listed[at + 1:]
        page = listed[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > limit}

    @router.post("/v1/responses/{response_id}/cancel", responses={404: OPENAI_RESPONSES[400]})
    async def cancel(response_id: str) -> dict[str, Any]:
        stored(response_id)
        raise OpenAIError(400, "only background responses can be cancelled, and this server runs "
                               "none (background: true is refused)", "response_id")

    @router.delete("/v1/responses/{response_id}", responses={404: OPENAI_RESPONSES[400]})
    async def delete(response_id: str) -> dict[str, Any]:
        stored(response_id)
        kept = store()
        assert kept is not None
        kept.delete(current_tenant(), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def handle(raw: bytes, scope: Scope) -> Awaitable[Response]:
        return run(raw, scope)

    return router, {"/v1/responses": handle}
