"""The router's FastAPI app: OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health` (readiness), `/livez` (liveness), `/metrics`, and the admin API (admin.py).

    app = create_app(RouterConfig(model="m", tokenizer="/models/m", max_model_len=4096,
                                  dispatch=DispatchOptions(prefill=(...), decode=(...))))

Each request is validated (its structured-output constraint checked and given its grammar
backend: structured.py), each of its prompts tokenized once (chat template included;
generation.py) and fanned out into `n` (or `best_of`) samples (fanout.py), each dispatched
prefill -> decode (dispatch.py); the router detokenizes incrementally and applies stop strings,
cancelling the decode call on a match; render.py writes the responses. The edge (edge.py) limits
body sizes and read times; serve it with `services.router.edge.serve`.
"""

from __future__ import annotations

import copy
import gc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sampling_params import SamplingParams
from services.procs import instance_id
from services.router.admin import admin_router
from services.router.chat_options import echo_text, reply_role, template_options
from services.router.config import RouterConfig
from services.router.dispatch import Dispatcher
from services.router.edge import BodyLimit
from services.router.errors import OpenAIError, field_path
from services.router.fanout import RunOptions
from services.router.generation import Generator
from services.router.hot_path import HotPath
from services.router.metrics import RouterMetrics
from services.router.openai_models import (
    HEALTH_RESPONSES,
    MODELS_RESPONSES,
    OPENAI_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    models_body,
)
from services.router.other_endpoints import endpoints_router
from services.router.prompt_render import echo_chars
from services.router.render import Reply, respond
from services.router.structured import requested
from services.router.tenants import ApiKeyAuth, request_salt
from services.router.tokens_api import tokens_router
from services.router.tools import chat_template_text, constrain, tool_plan
from services.router.unsupported import log_ignored

__all__ = ["RouterConfig", "create_app"]

_Body = TypeVar("_Body", bound=pydantic.BaseModel)


def create_app(config: RouterConfig, tokenizer: Any = None) -> FastAPI:
    """The router app; the dispatcher (and its gRPC channels) lives in the app's event loop."""
    if tokenizer is None:  # a model name (the default one included), folder or hub id
        from engine.model.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(config.tokenizer))
    if config.chat_template is not None:  # vLLM's --chat-template: every chat renders with it
        tokenizer = copy.copy(tokenizer)  # a caller's tokenizer keeps its own
        tokenizer.chat_template = chat_template_text(config.chat_template)
    state: dict[str, Generator] = {}
    me = instance_id()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        holder: list[RouterMetrics] = []
        dispatcher = Dispatcher(config.dispatch,
                                on_decision=lambda d: holder[0].decisions.labels(d).inc(),
                                on_prefill_failure=lambda w: holder[0].prefill_failures.labels(w).inc(),
                                on_migration=lambda why: holder[0].migrations.labels(why).inc())
        holder.append(RouterMetrics(config.model, dispatcher.pools, config.max_model_len))
        state["gen"] = Generator(config, tokenizer, dispatcher, holder[0])
        dispatcher.start()
        # What exists now (tokenizer, torch, FastAPI, pydantic: millions of objects) lives as long as
        # the router; out of the collector's sight, collections stay short (as vLLM's server does).
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            state["gen"].close()
            await dispatcher.close()

    docs = not config.disable_docs
    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    _add_error_handlers(app)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        """Readiness: 200 while at least one decode (or colocated) worker is healthy, else 503."""
        gen = state["gen"]
        pools = {p.role: {"healthy": len(p.healthy), "workers": len(p.workers)}
                 for p in gen.dispatcher.pools}
        ok = bool(gen.dispatcher.decode.healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": pools, "instance_id": me},
                            status_code=200 if ok else 503)

    @app.get("/ping", responses=HEALTH_RESPONSES)
    async def ping() -> JSONResponse:
        """vLLM's /ping (SageMaker's probe): /health's status."""
        return await health()

    @app.post("/ping", responses=HEALTH_RESPONSES)
    async def ping_post() -> JSONResponse:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _VERSION}

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """Liveness: 200 while the router's event loop answers (restarting it would not help a
        router whose workers are down: that is /health's 503)."""
        return {"status": "alive", "instance_id": me}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["gen"].metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(admin_router(lambda: state["gen"].dispatcher))
    app.include_router(tokens_router(config, lambda: state["gen"]))
    app.include_router(endpoints_router())

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        return models_body(config.model)

    @app.get("/v1/models/{model_id:path}", responses=MODELS_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(config, model_id)
        card: dict[str, Any] = models_body(config.model)["data"][0]
        return card

    @app.post("/v1/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        _check_model(config, body.model)
        log_ignored("completions", body.model_extra)
        gen = state["gen"]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        keep = gen.truncation(body.truncate_prompt_tokens, max_tokens)
        prompts = [gen.check_token_ids(p, "prompt", keep) if isinstance(p, list)
                   else await gen.tokenize(p, "prompt", truncate=keep) for p in body.prompts]
        lens = tuple(len(ids) for ids in prompts)
        fields = body.sampling_kwargs()
        if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs too
            fields["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
        fields["structured_outputs"] = await gen.constrain(requested(body))
        params = gen.params(max(lens), max_tokens, fields, body.logprobs)
        echo = await _echo_texts(gen, body, prompts) if body.echo else ()
        reply = Reply(gen, body.model, f"cmpl-{uuid.uuid4().hex}", lens, body.n, False,
                      body.include_usage, body.continuous_usage, echo_prompts=echo,
                      echo_offsets=tuple(echo_chars(gen.tokenizer, p) for p in prompts) if echo else (),
                      prompts=tuple(prompts), logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
        return await _run(reply, prompts, _options(body, params, body.best_of), body.stream)

    @app.post("/v1/chat/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def chat(body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        _check_model(config, body.model)
        log_ignored("chat.completions", body.model_extra)
        gen = state["gen"]
        tools = tool_plan(body, config.auto_tools,
                          lambda spec: gen.backends.choose(spec, config.structured_outputs_backend))
        template = replace(template_options(body, body.messages, gen.tokenizer), tools=tools.template_tools)
        keep = gen.truncation(body.truncate_prompt_tokens, body.token_limit)
        ids = await gen.tokenize([m.as_template_dict() for m in body.messages], "messages", template, keep)
        top = (body.top_logprobs or 0) if body.logprobs else None
        fields = {**body.sampling_kwargs(), "structured_outputs": await gen.constrain(requested(body))}
        constrain(fields, tools)  # tool_choice required / named: its grammar, or a 400 beside another
        params = gen.params(len(ids), body.token_limit, fields, top)
        reply = Reply(gen, body.model, f"chatcmpl-{uuid.uuid4().hex}", (len(ids),), body.n, True,
                      body.include_usage, body.continuous_usage, role=reply_role(body, body.messages),
                      echo=echo_text(body, body.messages, body.echo), prompt_logprobs=body.prompt_logprobs,
                      tools=tools if tools.parses else None)
        return await _run(reply, [ids], _options(body, params), body.stream)

    # Added before the API key check, so that check (outside it) still sees every request; the
    # body limit outermost, so no handler ever reads more than max_body_bytes.
    app.add_middleware(HotPath, handlers={"/v1/completions": _from_bytes(CompletionRequest, completions),
                                          "/v1/chat/completions": _from_bytes(ChatCompletionRequest, chat)})
    app.add_middleware(ApiKeyAuth, keys=config.api_keys, tenants=config.tenant_cache_salt,
                       admin_keys=config.admin_keys)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


async def _echo_texts(gen: Generator, body: CompletionRequest, prompts: list[list[int]]) -> tuple[str, ...]:
    """What each choice of an echoing completion starts with: its prompt as sent (the text of its
    token ids for an id prompt, or once truncate_prompt_tokens cut it)."""
    texts = []
    for sent, ids in zip(body.prompts, prompts, strict=True):
        whole = isinstance(sent, str) and body.truncate_prompt_tokens is None
        texts.append(sent if isinstance(sent, str) and whole else (await gen.decode(ids, "prompt"))[0])
    return tuple(texts)


def _options(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
             best_of: int | None = None) -> RunOptions:
    return RunOptions(params, body.n, best_of, tuple(body.stop_strings), body.include_stop_str_in_output,
                      body.skip_special_tokens, body.spaces_between_special_tokens, body.priority,
                      request_salt(body.cache_salt))


async def _run(reply: Reply, prompts: list[list[int]], opts: RunOptions, stream: bool
               ) -> JSONResponse | StreamingResponse:
    gen = reply.gen
    admission = gen.admit()
    gen.metrics.prompt_tokens.inc(sum(reply.prompt_lens))
    deltas = gen.run(reply.request_id, prompts, opts)
    return await respond(reply, deltas, stream, admission)


def _from_bytes(model: type[_Body], endpoint: Callable[[_Body], Awaitable[Response]]
                ) -> Callable[[bytes], Awaitable[Response | None]]:
    """A HotPath handler: the raw body validated as `model`, then `endpoint`, its OpenAIErrors
    turned into their responses as the app's handler does. A body that does not validate gives
    None: FastAPI then parses it again (`json.loads`, then the model) and answers with its error
    handlers' 400. Pydantic's own JSON parser gives the validators the same values as
    `json.loads`, in one pass, ~30% faster."""
    async def handle(raw: bytes) -> Response | None:
        try:
            body = model.model_validate_json(raw)
        except (ValueError, RecursionError):  # ValidationError is a ValueError
            return None
        try:
            return await endpoint(body)
        except OpenAIError as e:
            return e.response()

    return handle


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


_VERSION = _version()


def _check_model(config: RouterConfig, model: str) -> None:
    if model != config.model:
        raise OpenAIError(404, f"the model '{model}' does not exist", "model", "model_not_found")


def _is_union_tag(part: object) -> bool:
    """Pydantic names the union member tried in an error's location (`str`, `list[int]`,
    `constrained-str`): not a field (field names are identifiers)."""
    text = str(part)
    return isinstance(part, str) and ("[" in text or "-" in text or text in _TYPE_TAGS
                                      or text[:1].isupper())


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return OpenAIError(400, f"malformed JSON body: {detail}").response()
        param = field_path(p for p in first.get("loc", ())[1:] if not _is_union_tag(p)) or None
        msg = first.get("msg", "invalid value")
        message = f"{param}: {msg}" if param else msg
        return OpenAIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail)).response()


