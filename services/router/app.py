"""The router's FastAPI app: OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/models`,
`/health` (readiness), `/livez` (liveness), `/metrics`, the tokenizer and admin APIs.

    app = create_app(RouterConfig(model="m", tokenizer="/models/m", max_model_len=4096,
                                  dispatch=DispatchOptions(prefill=(...), decode=(...))))

The layout of services/router/: `http/` is the HTTP surface (routes, the edge's limits and
timeouts, the hot path, API keys, liveness, the response writers); `api/` the OpenAI request
features (the request models, tools, reasoning, structured outputs, chat options, the body's shape);
`responses/` the Responses API (run on the chat path); `dispatch/` the worker pools, prefix
index and calls in flight (prefill -> decode, migration);
`prepare.py` turns a raw body into prompts and sampling parameters (on the loop or in the
tokenizer pool), `generation.py` runs a request's samples (`fanout.py`: n, best_of) and
detokenizes them. Serve the app with `services.router.http.edge.serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services import tracing
from services.procs import instance_id
from services.router.api.tools import chat_template_text
from services.router.config import DEFAULT_MAX_MODEL_LEN, RouterConfig
from services.router.dispatch.dispatcher import Dispatcher
from services.router.generation import Generator
from services.router.http.admin import admin_router, parse_networks
from services.router.http.edge import BodyLimit
from services.router.http.errors_http import add_error_handlers
from services.router.http.health import health_router
from services.router.http.heavy import PoolLimits
from services.router.http.hot_path import HotPath
from services.router.http.liveness import LivenessServer, LoopWatch
from services.router.http.openai_routes import openai_routes
from services.router.http.other_endpoints import endpoints_router
from services.router.http.tenants import ApiKeyAuth
from services.router.http.tokens_api import tokens_router
from services.router.http.trace_requests import TraceRequests
from services.router.metrics import RouterMetrics
from services.router.responses.routes import responses_routes
from services.router.responses.store import ResponseStore

__all__ = ["RouterConfig", "create_app"]


class RouterState:
    """What the app's lifespan makes and its routes use (it lives in the app's event loop)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._gen: Generator | None = None
        self.limits = PoolLimits(config)
        self.watch = LoopWatch()
        self.responses = (ResponseStore(config.responses_store_size, config.responses_store_mb * 2**20)
                          if config.enable_responses_store else None)

    @property
    def gen(self) -> Generator:
        assert self._gen is not None, "the router's lifespan has not started"
        return self._gen

    @asynccontextmanager
    async def lifespan(self, tokenizer: Any) -> AsyncIterator[None]:
        holder: list[RouterMetrics] = []
        dispatcher = Dispatcher(self.config.dispatch,
                                on_decision=lambda d: holder[0].decisions.labels(d).inc(),
                                on_prefill_failure=lambda w: holder[0].prefill_failures.labels(w).inc(),
                                on_migration=lambda why: holder[0].migrations.labels(why).inc(),
                                on_handoff=lambda s, mode: holder[0].handoff.labels(mode).observe(s),
                                on_prefix=lambda pool, exact, expected, found: holder[0].prefix_tokens(
                                    pool, exact, expected, found))
        holder.append(RouterMetrics(self.config.model, dispatcher.pools,
                                    self.config.max_model_len or DEFAULT_MAX_MODEL_LEN))
        self._gen = Generator(self.config, tokenizer, dispatcher, holder[0])
        dispatcher.start()
        watching = asyncio.get_running_loop().create_task(self.watch.run())
        # What exists now (tokenizer, torch, FastAPI, pydantic: millions of objects) lives as long as
        # the router; out of the collector's sight, collections stay short (as vLLM's server does).
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            self.gen.close()
            await dispatcher.close()


def router_tokenizer(config: RouterConfig) -> Any:
    """The tokenizer of `config.tokenizer` (a model name, folder or hub id), with --chat-template's."""
    from engine.model.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer))
    if config.chat_template is not None:  # vLLM's --chat-template: every chat renders with it
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template_text(config.chat_template)
    return tokenizer


def create_app(config: RouterConfig) -> FastAPI:
    """The router app; the dispatcher (and its gRPC channels) lives in the app's event loop."""
    tokenizer = router_tokenizer(config)
    state = RouterState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with state.lifespan(tokenizer):
            yield

    docs = not config.disable_docs
    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.router = state
    add_error_handlers(app)
    app.include_router(health_router(lambda: state.gen, instance_id(), _version()))
    app.include_router(admin_router(lambda: state.gen.dispatcher, parse_networks(config.worker_networks)))
    app.include_router(tokens_router(config, lambda: state.gen, lambda: state.limits))
    app.include_router(endpoints_router())
    routes, hot = openai_routes(lambda: state.gen, lambda: state.limits)
    app.include_router(routes)
    responses, responses_hot = responses_routes(lambda: state.gen, lambda: state.limits,
                                                lambda: state.responses)
    app.include_router(responses)
    # Added before the API key check, so that check (outside it) still sees every request; the
    # body limit outermost, so no handler ever reads more than max_body_bytes.
    app.add_middleware(HotPath, handlers={**hot, **responses_hot})
    app.add_middleware(ApiKeyAuth, keys=config.api_keys, tenants=config.tenant_cache_salt,
                       admin_keys=config.admin_keys)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    tracer = tracing.tracer()
    if tracer is not None:  # outermost: the request's root span covers all of it
        app.add_middleware(TraceRequests, tracer=tracer)
    return app


def liveness_server(app: FastAPI, host: str, port: int, stall_s: float) -> LivenessServer:
    """The app's off-loop liveness server (not started)."""
    state: RouterState = app.state.router
    return LivenessServer(state.watch, host, port, stall_s, instance_id())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"
