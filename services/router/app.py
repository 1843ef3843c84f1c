"""The router's FastAPI app: OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

    app = create_app(RouterConfig(model="m", tokenizer="/models/m", max_model_len=4096,
                                  dispatch=DispatchOptions(prefill=(...), decode=(...))))

Each request is validated, tokenized once (chat template included), fanned out into `n` samples,
each dispatched prefill -> decode; the router detokenizes incrementally and applies stop strings,
cancelling the decode call on a match.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.output_processor import find_stop_string
from engine.processor import Processor, child_request_id
from engine.sampling_params import SamplingParams
from protos import worker_pb2 as pb
from services.router.dispatch import Dispatcher, DispatchOptions, NoWorkerError
from services.router.hot_path import HotPath, SSEResponse
from services.router.metrics import RouterMetrics
from services.router.openai_models import (
    HEALTH_RESPONSES,
    MODELS_RESPONSES,
    OPENAI_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    WorkerChange,
    completion_body,
    error_body,
    models_body,
    usage_body,
)

_Body = TypeVar("_Body", bound=pydantic.BaseModel)


@dataclass(frozen=True)
class RouterConfig:
    model: str  # the served model name clients send
    tokenizer: str  # folder or hub id of the model's tokenizer
    max_model_len: int = 4096
    dispatch: DispatchOptions = field(default_factory=lambda: DispatchOptions(decode=("127.0.0.1:50061",)))
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_waiting: int = 64  # admission: 429 once every healthy worker of a pool has this many queued
    max_inflight: int = 4096  # admission: 429 beyond this many requests in the router
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.max_waiting < 1 or self.max_inflight < 1 or self.retry_after_s < 1:
            raise ValueError("max_waiting, max_inflight and retry_after_s must be at least 1")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        type_ = {401: "authentication_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse(error_body(self.message, type_, self.param, self.code), status_code=self.status,
                            headers=self.headers)


@dataclass
class Delta:
    """New output of one sample; the last one has finish_reason set. One with neither tokens nor
    finish_reason (`accepted`) only says a worker has the sample and is computing its prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[pb.PositionLogprobs]
    finish_reason: str | None
    completion_tokens: int
    cached_tokens: int
    text_offset: int = 0  # characters of this sample's token strings before this delta's tokens
    top_n: int = 0  # top logprobs asked for per position

    @property
    def accepted(self) -> bool:
        return not self.token_ids and not self.finish_reason


class Admission:
    """One admitted request's hold on the router's in-flight count; `release` is idempotent."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.released = False
        gen.inflight += 1
        gen.metrics.running.inc()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gen.inflight -= 1
            self.gen.metrics.running.dec()

    async def release_async(self) -> None:
        """`release` for Starlette's BackgroundTask, which runs a sync function in a worker thread."""
        self.release()


class Generator:
    """Tokenizes a request, runs its samples, turns their token ids into text deltas."""

    def __init__(self, config: RouterConfig, tokenizer: Any, dispatcher: Dispatcher,
                 metrics: RouterMetrics) -> None:
        self.processor = Processor(EngineConfig(model=config.tokenizer, max_model_len=config.max_model_len),
                                   tokenizer)
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.inflight = 0

    def admit(self) -> Admission:
        """Admission control, before any work: 429 (with Retry-After) when the router holds
        `max_inflight` requests or every healthy worker of a pool has `max_waiting` queued; 503 when
        no decode worker is healthy (no healthy prefill worker is fine: decode computes prompts)."""
        cfg = self.config
        retry = {"Retry-After": str(cfg.retry_after_s)}
        if not self.dispatcher.decode.healthy:
            self.metrics.rejected.labels("no_healthy_worker").inc()
            raise OpenAIError(503, f"no healthy {self.dispatcher.decode.role} worker; retry later",
                              code="worker_unavailable", headers=retry)
        if self.inflight >= cfg.max_inflight:
            self.metrics.rejected.labels("router_full").inc()
            raise OpenAIError(429, f"the router already serves {self.inflight} requests "
                                   f"(max_inflight={cfg.max_inflight}); retry later",
                              code="rate_limit_exceeded", headers=retry)
        for pool in self.dispatcher.pools:
            if pool.saturated(cfg.max_waiting):
                self.metrics.rejected.labels(f"{pool.role}_queue_full").inc()
                raise OpenAIError(429, f"every {pool.role} worker has {cfg.max_waiting} or more queued "
                                       f"requests; retry later", code="rate_limit_exceeded", headers=retry)
        return Admission(self)

    def tokenize(self, prompt: str | list[int] | list[dict[str, Any]], param: str) -> list[int]:
        try:
            return self.processor.preprocess(prompt)[1]
        except ValueError as e:
            raise OpenAIError(400, str(e), param) from e

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        """A token-id prompt whose items pydantic already checked are ints: length and range only."""
        try:
            return self.processor.check_token_ids(token_ids)
        except ValueError as e:
            raise OpenAIError(400, str(e), param) from e

    def params(self, prompt_len: int, max_tokens: int | None, fields: dict[str, Any],
               logprobs: int | None) -> SamplingParams:
        """One sample's SamplingParams; the engine's own checks become 400s naming the field."""
        room = self.processor.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed "
                                   f"max_model_len={self.processor.max_model_len}", "max_tokens")
        try:
            return SamplingParams(**fields, logprobs=logprobs,
                                  max_tokens=room if max_tokens is None else max_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), str(e).split(" ", 1)[0]) from e

    async def run(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int,
                  stops: list[str]) -> AsyncGenerator[Delta, None]:
        """The deltas of all `n` samples, interleaved as they come."""
        if n == 1:
            async with aclosing(self._sample(request_id, 0, prompt_ids, params, stops)) as sample:
                async for delta in sample:
                    yield delta
            return
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta in self._sample(child_request_id(request_id, i), i, prompt_ids,
                                                 params.for_child(i), stops):
                    queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as e:
                queue.put_nowait(e)

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        try:
            for _ in range(n):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sample(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                      stops: list[str]) -> AsyncGenerator[Delta, None]:
        detok = IncrementalDetokenizer(self.tokenizer)
        hold_back = max((len(s) for s in stops), default=1) - 1
        text, sent, num_tokens, token_chars = "", 0, 0, 0
        start = last = time.perf_counter()
        async with aclosing(self.dispatcher.generate(request_id, prompt_ids, params)) as steps:
            async for step in steps:
                if step.accepted:  # a worker has the sample: nothing to say yet
                    yield Delta(index, "", [], [], None, num_tokens, 0)
                    continue
                now = time.perf_counter()
                if step.token_ids:
                    (self.metrics.ttft if num_tokens == 0 else self.metrics.itl).observe(now - last)
                    last = now
                num_tokens += len(step.token_ids)
                checked = len(text)
                text += detok.update(step.token_ids, finished=bool(step.finish_reason))
                finish = step.finish_reason or None
                match = find_stop_string(text, checked, stops, include_stop_str=False)
                if match is not None:
                    text, finish = text[:match[1]], "stop"
                end = len(text) if finish else max(sent, len(text) - hold_back)
                if finish:
                    self.metrics.e2e.observe(now - start)
                    self.metrics.success.labels(self.config.model, finish).inc()
                    self.metrics.generation_tokens.inc(num_tokens)
                yield Delta(index, text[sent:end], step.token_ids, step.logprobs, finish, num_tokens,
                            step.cached_tokens, token_chars, params.logprobs or 0)
                if step.logprobs:  # completions' logprobs.text_offset continues from here
                    token_chars += sum(len(decode_token(self.tokenizer, t)) for t in step.token_ids)
                sent = end
                if finish:
                    return  # leaving the loop early cancels the decode call


def _rpc_error(e: grpc.RpcError) -> OpenAIError:
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return OpenAIError(400, str(details))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, "the worker timed out", code="timeout")
    return OpenAIError(503, f"worker unavailable: {details}", code="worker_unavailable")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def create_app(config: RouterConfig, tokenizer: Any = None) -> FastAPI:
    """The router app; the dispatcher (and its gRPC channels) lives in the app's event loop."""
    if tokenizer is None:  # a model name (the default one included), folder or hub id
        from engine.model.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(config.tokenizer))
    state: dict[str, Generator] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        holder: list[RouterMetrics] = []
        dispatcher = Dispatcher(config.dispatch,
                                on_decision=lambda d: holder[0].decisions.labels(d).inc(),
                                on_prefill_failure=lambda w: holder[0].prefill_failures.labels(w).inc())
        holder.append(RouterMetrics(config.model, dispatcher.pools))
        state["gen"] = Generator(config, tokenizer, dispatcher, holder[0])
        dispatcher.start()
        # What exists now (tokenizer, torch, FastAPI, pydantic: millions of objects) lives as long as
        # the router; out of the collector's sight, collections stay short (as vLLM's server does).
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await dispatcher.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    _add_error_handlers(app)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        """200 while at least one decode (or colocated) worker is healthy, else 503."""
        gen = state["gen"]
        pools = {p.role: {"healthy": len(p.healthy), "workers": len(p.workers)}
                 for p in gen.dispatcher.pools}
        ok = bool(gen.dispatcher.decode.healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": pools},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["gen"].metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def pool_of(role: str) -> Any:
        pools = {p.role: p for p in state["gen"].dispatcher.pools}
        if role not in pools:
            raise OpenAIError(400, f"role must be one of {sorted(pools)}, got {role!r}", "role")
        return pools[role]

    @app.get("/admin/workers")
    async def list_workers() -> dict[str, Any]:
        """Every worker the router knows, by pool (for the autoscaler and operators)."""
        return {"workers": [{"role": p.role, "target": w.target, "healthy": w.healthy,
                             "draining": w.draining, "inflight": w.inflight, "dispatched": w.requests,
                             "waiting": w.load.num_waiting if w.load else 0,
                             "running": w.load.num_running if w.load else 0,
                             "kv_usage": w.load.kv_usage if w.load else 0.0,
                             "prompt_tokens": w.load.num_prompt_tokens if w.load else 0,
                             "busy_seconds": w.load.busy_seconds if w.load else 0.0}
                            for p in state["gen"].dispatcher.pools for w in p.workers]}

    @app.post("/admin/workers")
    async def add_worker(body: WorkerChange) -> dict[str, Any]:
        """Registers a worker (idempotent); it gets requests once its first load report is in."""
        w = pool_of(body.role).add(body.target)
        return {"target": w.target, "role": body.role, "healthy": w.healthy}

    @app.post("/admin/workers/drain")
    async def drain_worker(body: WorkerChange) -> dict[str, Any]:
        """No new requests for the worker; `inflight` says how many are still running there."""
        w = pool_of(body.role).drain(body.target)
        if w is None:
            raise OpenAIError(404, f"no {body.role} worker {body.target}", "target")
        return {"target": w.target, "draining": True, "inflight": w.inflight}

    @app.post("/admin/workers/remove")
    async def remove_worker(body: WorkerChange) -> JSONResponse:
        """Forgets a worker: 409 while it still has requests in flight, unless `force`."""
        pool = pool_of(body.role)
        w = pool.find(body.target)
        if w is not None and not w.draining and not body.force:
            raise OpenAIError(409, f"drain {body.target} before removing it", "target")
        if not await pool.remove(body.target, force=body.force):
            raise OpenAIError(409, f"{body.target} still has {w.inflight if w else 0} requests in "
                                   f"flight", "target")
        return JSONResponse({"target": body.target, "removed": True})

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        return models_body(config.model)

    @app.post("/v1/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        _check_model(config, body.model)
        gen = state["gen"]
        ids = (gen.check_token_ids(body.prompt, "prompt") if isinstance(body.prompt, list)
               else gen.tokenize(body.prompt, "prompt"))
        params = gen.params(len(ids), body.max_tokens if body.max_tokens is not None else 16,
                            body.sampling_kwargs(), body.logprobs)
        return await _respond(gen, body.model, f"cmpl-{uuid.uuid4().hex}", ids, params, body.n,
                              body.stop_strings, body.stream, body.include_usage, chat=False)

    @app.post("/v1/chat/completions", response_model=None, responses=OPENAI_RESPONSES)
    async def chat(body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        _check_model(config, body.model)
        gen = state["gen"]
        ids = gen.tokenize([m.as_template_dict() for m in body.messages], "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = gen.params(len(ids), body.token_limit, body.sampling_kwargs(), top)
        return await _respond(gen, body.model, f"chatcmpl-{uuid.uuid4().hex}", ids, params, body.n,
                              body.stop_strings, body.stream, body.include_usage, chat=True)

    # Added before the API key check, so that check (outside it) still sees every request.
    app.add_middleware(HotPath, handlers={"/v1/completions": _from_bytes(CompletionRequest, completions),
                                          "/v1/chat/completions": _from_bytes(ChatCompletionRequest, chat)})
    if config.api_key:
        _require_api_key(app, config.api_key)
    return app


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


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """`/v1/*` and `/admin/*` answer 401 without `Authorization: Bearer <api_key>` (as vLLM's --api-key);
    `/health` and `/metrics` stay open for probes and scrapers."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith(("/v1", "/admin")):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                                        "<key>'", code="invalid_api_key").response()
        response: Response = await call_next(request)
        return response


def _check_model(config: RouterConfig, model: str) -> None:
    if model != config.model:
        raise OpenAIError(404, f"the model '{model}' does not exist", "model", "model_not_found")


def _is_union_tag(part: object) -> bool:
    """Pydantic names the union member tried in an error's location (`str`, `list[int]`): not a field."""
    text = str(part)
    return isinstance(part, str) and ("[" in text or text in _TYPE_TAGS or text[:1].isupper())


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
        loc = [str(p) for p in first.get("loc", ())[1:] if not _is_union_tag(p)]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid value")
        message = f"{param}: {msg}" if param else msg
        return OpenAIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail)).response()


async def _respond(gen: Generator, model: str, request_id: str, ids: list[int], params: SamplingParams,
                   n: int, stops: list[str], stream: bool, include_usage: bool, chat: bool
                   ) -> JSONResponse | StreamingResponse:
    admission = gen.admit()
    streaming = False  # once the stream owns the admission, it releases it
    try:
        gen.metrics.prompt_tokens.inc(len(ids))
        deltas = gen.run(request_id, ids, params, n, stops)
        try:
            first = await anext(deltas)
        except grpc.RpcError as e:
            await deltas.aclose()
            raise _rpc_error(e) from e
        except NoWorkerError as e:
            await deltas.aclose()
            raise OpenAIError(503, f"{e}; retry later", code="worker_unavailable",
                              headers={"Retry-After": str(gen.config.retry_after_s)}) from e
        if stream:
            streaming = True
            body = _stream(gen, model, request_id, len(ids), n, first, deltas, include_usage, chat, admission)
            return SSEResponse(body, media_type="text/event-stream",
                               background=BackgroundTask(admission.release_async))
        try:
            async with aclosing(deltas):
                collected = [d for d in [first] + [d async for d in deltas] if not d.accepted]
        except grpc.RpcError as e:
            raise _rpc_error(e) from e
        return JSONResponse(_full_body(gen, model, request_id, len(ids), n, collected, chat))
    finally:
        if not streaming:
            admission.release()


async def _stream(gen: Generator, model: str, request_id: str, prompt_len: int, n: int, first: Delta,
                  deltas: AsyncGenerator[Delta, None], include_usage: bool, chat: bool,
                  admission: Admission) -> AsyncIterator[str]:
    try:
        async for chunk in _stream_chunks(gen, model, request_id, prompt_len, n, first, deltas,
                                          include_usage, chat):
            yield chunk
    finally:
        admission.release()


async def _stream_chunks(gen: Generator, model: str, request_id: str, prompt_len: int, n: int,
                         first: Delta, deltas: AsyncGenerator[Delta, None], include_usage: bool,
                         chat: bool) -> AsyncIterator[str]:
    finals: dict[int, Delta] = {}
    started: set[int] = set()
    try:
        async with aclosing(deltas):
            delta: Delta | None = first
            while delta is not None:
                if delta.accepted:
                    delta = await anext(deltas, None)
                    continue
                role_event = ""  # a sample's first chat event names the role; it leaves with the text
                if chat and delta.index not in started:
                    started.add(delta.index)
                    role = {"index": delta.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}
                    role_event = _sse(completion_body(request_id, model, [role], None, chunk=True, chat=True))
                if delta.finish_reason:
                    finals[delta.index] = delta
                choice = _choice(gen, delta, delta.text, chat, stream=True)
                yield role_event + _sse(completion_body(request_id, model, [choice], None, chunk=True,
                                                        chat=chat))
                delta = await anext(deltas, None)
    except grpc.RpcError as e:
        error = _rpc_error(e)
        yield _sse(error_body(error.message, "server_error", None, error.code))
    if include_usage:
        yield _sse(completion_body(request_id, model, [], _usage(prompt_len, finals.values()), chunk=True,
                                   chat=chat))
    yield "data: [DONE]\n\n"


def _full_body(gen: Generator, model: str, request_id: str, prompt_len: int, n: int,
               deltas: Sequence[Delta], chat: bool) -> dict[str, Any]:
    choices = []
    for i in range(n):
        mine = [d for d in deltas if d.index == i]
        merged = Delta(i, "".join(d.text for d in mine), [t for d in mine for t in d.token_ids],
                       [lp for d in mine for lp in d.logprobs], mine[-1].finish_reason,
                       mine[-1].completion_tokens, mine[0].cached_tokens, mine[0].text_offset,
                       mine[0].top_n)
        choices.append(_choice(gen, merged, merged.text, chat, stream=False))
    finals = [d for d in deltas if d.finish_reason]
    return completion_body(request_id, model, choices, _usage(prompt_len, finals), chat=chat)


def _usage(prompt_len: int, finals: Any) -> dict[str, Any]:
    finals = list(finals)
    return usage_body(prompt_len, sum(d.completion_tokens for d in finals),
                      max((d.cached_tokens for d in finals), default=0))


def _choice(gen: Generator, delta: Delta, text: str, chat: bool, stream: bool) -> dict[str, Any]:
    logprobs = _logprobs(gen, delta, chat) if delta.logprobs else None
    if not chat:
        return {"index": delta.index, "text": text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}
    key, content = ("delta", {"content": text}) if stream else ("message", {"role": "assistant",
                                                                             "content": text})
    return {"index": delta.index, key: content, "logprobs": logprobs, "finish_reason": delta.finish_reason}


def _top(candidates: list[pb.Logprob], n: int, with_sampled: bool) -> list[pb.Logprob]:
    """The top `n` candidates by rank. The worker sends the sampled token first, then the top n
    without repeating it. Completions (`with_sampled`) also list the sampled token when it is
    outside the top n, as OpenAI and vLLM do (up to logprobs + 1 entries); chat lists exactly n."""
    top = sorted((c for c in candidates if 1 <= c.rank <= n), key=lambda c: c.rank)
    if with_sampled and candidates and candidates[0].rank > n:
        top.append(candidates[0])
    return top


def _logprobs(gen: Generator, delta: Delta, chat: bool) -> dict[str, Any]:
    """OpenAI logprobs of the delta's tokens; `candidates[0]` of each position is the sampled token."""
    tok = gen.tokenizer
    positions = [(decode_token(tok, tid), pos)
                 for tid, pos in zip(delta.token_ids, delta.logprobs, strict=False)]
    sampled = [pos.candidates[0].logprob if pos.candidates else 0.0 for _, pos in positions]
    tops = [[(decode_token(tok, c.token_id), c.logprob)
             for c in _top(list(pos.candidates), delta.top_n, not chat)] for _, pos in positions]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                              for s, v in top]}
                            for (t, _), lp, top in zip(positions, sampled, tops, strict=True)]}
    return {"tokens": [t for t, _ in positions], "token_logprobs": sampled,
            "top_logprobs": [dict(top) for top in tops],
            "text_offset": list(itertools.accumulate((len(t) for t, _ in positions[:-1]),
                                                     initial=delta.text_offset)) if positions else []}
