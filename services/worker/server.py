"""The prefill / decode / colocated gRPC worker: one AsyncLLM (core in its own process) behind
the `pdserve.worker.v1.Worker` service and the standard gRPC health service.

Roles: "prefill" runs its engine as a KV producer and offers Prefill; "decode" runs a KV consumer
and offers Decode; "colocated" has no connector and offers Decode, computing the whole prompt.
The servicer is a thin adapter: it validates, converts (convert.py), and maps engine errors to
status codes. Cancelling a call aborts its engine request. With `metrics_port` set, the worker
also serves Prometheus metrics over HTTP (services/worker/metrics.py).

Health tells the truth (engine_guard.py): the engine core is watched, and one that died, froze
or hung is killed and restarted while health says NOT_SERVING; Load always answers and says
whether the worker serves, and why not. A Decode stream with nothing new for `heartbeat_s`
gets an empty chunk while the engine core is alive, so a caller can tell a quiet stream from a
stalled worker. The server listens exclusively (no SO_REUSEPORT): a second worker on a taken
port fails at start with an error naming it.

With a token, every call but health's needs `authorization: Bearer <token>`; with TLS files the
port is TLS (mutual with a client CA). Without either credential a worker listens only on
loopback unless `no_auth` (services/worker/auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Literal, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.connector.transfer_params import check_transfer_params
from engine.core.outputs import EngineStats
from engine.core_client import EngineDeadError
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams
from kvstore.credentials import TLSFiles
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services.procs import PortInUseError, instance_id, port_free, port_in_use_message
from services.worker.auth import TokenInterceptor, check_exposure, server_credentials
from services.worker.convert import (
    MESSAGE_SIZE_OPTIONS,
    chunk_from_output,
    kv_params_from_proto,
    kv_params_to_proto,
    params_from_proto,
    position_to_proto,
    prompt_logprobs_to_proto,
    token_ids_from_proto,
)
from services.worker.engine_guard import EngineGaveUp, EngineGuard, GuardOptions
from services.worker.heartbeats import with_heartbeats
from services.worker.metrics import WorkerMetrics, cache_config_labels

logger = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode", "colocated"]
ROLES: tuple[WorkerRole, ...] = ("prefill", "decode", "colocated")
SERVICE_NAME = "pdserve.worker.v1.Worker"
LIVENESS = "liveness"  # health service name of the liveness probe (the others: readiness)
_KV_ROLES: dict[str, Literal["kv_producer", "kv_consumer"]] = {
    "prefill": "kv_producer", "decode": "kv_consumer"}
_PROTO_ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "colocated": pb.ROLE_COLOCATED}
T = TypeVar("T")
LOAD_WAIT_S = 0.2  # how long Load waits for a fresh snapshot before answering with the last one
FIRST_LOAD_WAIT_S = 5.0
SCRAPE_STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerOptions:
    """One worker process: its role, where it listens, and its engine (connector set by role)."""

    role: WorkerRole
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    grace_s: float = 10.0  # how long shutdown waits for in-flight calls
    metrics_port: int | None = None  # Prometheus /metrics on `host`; None = off, 0 = any free port
    heartbeat_s: float = 1.0  # an idle Decode stream gets an empty chunk this often
    reuse_port: bool = False  # SO_REUSEPORT: several worker processes share `port` (asked for only)
    guard: GuardOptions = field(default_factory=GuardOptions)
    served_model_name: str | None = None  # the metrics' model_name (the router's); None = engine.model
    token: str | None = field(default=None, repr=False)  # calls need `authorization: Bearer <token>`
    tls: TLSFiles = field(default_factory=TLSFiles)  # cert + key: TLS; ca: clients need certificates
    no_auth: bool = False  # may listen beyond loopback with neither token nor client certificates

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be non-negative, got {self.grace_s}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.tls.enabled and self.tls.cert is None:
            raise ValueError("tls: a worker's TLS needs its certificate and key (a client CA alone "
                             "is not enough)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def engine_config(self) -> EngineConfig:
        """The engine config with the KV connector the role needs (none when colocated)."""
        if self.role == "colocated":
            return replace(self.engine, kv_connector=None)
        return replace(self.engine, kv_connector="kvstore", kv_role=_KV_ROLES[self.role])


class WorkerServicer(pb_grpc.WorkerServicer):
    """Worker RPCs over the engine its guard keeps; UNAVAILABLE while that engine does not serve."""

    def __init__(self, role: WorkerRole, guard: EngineGuard, heartbeat_s: float = 1.0,
                 chunk_size: int = 256) -> None:
        self.role = role
        self.guard = guard
        self.heartbeat_s = heartbeat_s
        self.chunk_size = chunk_size  # kv_chunk_size: bounds a Decode's kv_transfer.keys
        self.instance_id = instance_id()
        self._active: set[str] = set()
        self._stats: EngineStats | None = None  # the last snapshot Load got
        self._stats_task: asyncio.Future[EngineStats] | None = None
        self._stats_engine: AsyncLLM | None = None  # whose snapshots those are

    @property
    def engine(self) -> AsyncLLM | None:
        return self.guard.engine

    def _keep_stats(self, engine: AsyncLLM, task: asyncio.Future[EngineStats]) -> None:
        if engine is self._stats_engine and not task.cancelled() and task.exception() is None:
            self._stats = task.result()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrefillResponse:
        if self.role != "prefill":
            await _fail(context, grpc.StatusCode.UNIMPLEMENTED, f"a {self.role} worker does not prefill")
        transfer = {"do_remote_decode": True, "transfer_id": request.transfer_id or request.request_id}
        one_token = pb.SamplingParams()
        one_token.CopyFrom(request.params)
        one_token.max_tokens, one_token.min_tokens = 1, min(one_token.min_tokens, 1)

        def parse() -> tuple[list[int], SamplingParams]:
            ids = token_ids_from_proto(request.token_ids)
            check_transfer_params(transfer, len(ids), self.chunk_size)
            return ids, params_from_proto(one_token, RequestOutputKind.FINAL_ONLY, transfer)

        ids, params = await _parse(context, parse)
        final: RequestOutput | None = None
        async for out in self._generate(context, request.request_id, ids, params, request.priority,
                                        cache_salt=request.cache_salt):
            final = out
        assert final is not None and final.finished
        sample = final.outputs[0]
        if not sample.token_ids:  # aborted before its first token (Abort, or a KV store failure)
            await _fail(context, grpc.StatusCode.ABORTED, f"prefill ended: {sample.stop_reason or 'abort'}")
        first = sample.token_ids[0]
        finish = sample.finish_reason or ""
        if finish == "length" and self._ends_request(first, params, request.params.min_tokens):
            finish = "stop"  # the first token ends it: no decode follows
        reply = pb.PrefillResponse(first_token_id=first, finish_reason=finish,
                                   kv_transfer=kv_params_to_proto(final.kv_transfer_params),
                                   num_cached_tokens=final.num_cached_tokens or 0)
        if sample.logprobs:
            reply.first_logprobs.CopyFrom(position_to_proto(sample.logprobs[0]))
        reply.prompt_logprobs.extend(prompt_logprobs_to_proto(final.prompt_logprobs))
        return reply

    def _ends_request(self, token: int, params: SamplingParams, min_tokens: int) -> bool:
        """Whether `token` as the first output stops the request: the engine reports "length" for
        it (prefill runs with max_tokens 1 and length is checked first, as in vLLM), but the
        request the router will continue must end here when it is EOS or a stop token id."""
        if min_tokens > 1:
            return False
        eos = self.engine.processor.eos_token_id if self.engine is not None else None
        return token in params.stop_token_ids or (not params.ignore_eos and token == eos)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.DecodeChunk]:
        if self.role == "prefill":
            await _fail(context, grpc.StatusCode.UNIMPLEMENTED, "a prefill worker does not decode")

        def parse() -> tuple[list[int], SamplingParams]:
            ids = token_ids_from_proto(request.token_ids)
            kv = (kv_params_from_proto(request.kv_transfer, len(ids), self.chunk_size)
                  if self.role == "decode" and request.HasField("kv_transfer") else None)
            return ids, params_from_proto(request.params, RequestOutputKind.DELTA, kv)

        ids, params = await _parse(context, parse)
        completion_tokens = 0
        outputs = self._generate(context, request.request_id, ids, params, request.priority,
                                 request.num_output_tokens, request.cache_salt)
        async for out in with_heartbeats(outputs, self.heartbeat_s,
                                         lambda: self.guard.core_alive(self.heartbeat_s)):
            if out is None:  # nothing new for a while, the engine alive: tell the caller
                yield pb.DecodeChunk()
                continue
            sample = out.outputs[0]
            completion_tokens += len(sample.token_ids)
            if not sample.token_ids and not out.finished:
                continue
            chunk = chunk_from_output(sample, out.prompt_logprobs)
            if out.finished:
                chunk.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                              cached_tokens=out.num_cached_tokens or 0))
            yield chunk

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        engine = await self._engine(context)
        found = request.request_id in self._active
        if found:
            await engine.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        """Whether the worker serves (and why not), its engine's queues and KV use. The engine
        core answers between steps, so a long step (a 2k-token prefill on CPU) would delay the
        report by up to a step: after LOAD_WAIT_S the last snapshot is returned instead, and the
        fresh one, when it comes, replaces it. Never fails: a worker whose engine is down says so."""
        serving = self.guard.serving
        why = "" if serving else self.guard.reason or "the engine core died"
        report = pb.LoadReport(role=_PROTO_ROLES[self.role], serving=serving, not_serving_reason=why,
                               instance_id=self.instance_id)
        stats = await self.snapshot(LOAD_WAIT_S)
        if stats is not None:
            report.MergeFrom(pb.LoadReport(
                num_waiting=stats.num_waiting, num_running=stats.num_running, kv_usage=stats.kv_usage,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
                num_cached_blocks=stats.num_cached_blocks, num_prompt_tokens=stats.num_prompt_tokens,
                busy_seconds=stats.step_seconds.total))
        return report

    async def snapshot(self, wait_s: float) -> EngineStats | None:
        """The engine's stats: a fresh snapshot when the core answers within `wait_s` (longer for
        an engine's first), else the last one; None without a live engine. Load and metrics
        scrapes share one request to the core, so a frozen core holds one thread, not one per
        call."""
        engine = self.engine
        if engine is None or engine.errored:
            return None
        if engine is not self._stats_engine:  # a restarted engine starts over
            self._stats_engine, self._stats, self._stats_task = engine, None, None
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(engine.get_stats())
            self._stats_task.add_done_callback(lambda task: self._keep_stats(engine, task))
        if self._stats is None:  # an engine's first snapshot: there is none to fall back on
            wait_s = max(wait_s, FIRST_LOAD_WAIT_S)
        try:
            return await asyncio.wait_for(asyncio.shield(self._stats_task), wait_s)
        except (TimeoutError, EngineDeadError):
            return self._stats if not engine.errored else None

    async def _generate(self, context: grpc.aio.ServicerContext, request_id: str, ids: list[int],
                        params: SamplingParams, priority: int = 0, num_prior_outputs: int = 0,
                        cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; errors become status codes, cancel aborts. The
        call's initial metadata goes out as soon as the engine has the request, so the client
        knows it was accepted before the first token (the router starts its HTTP response there).
        A non-empty `cache_salt` keeps the request's KV apart from other salts'."""
        engine = await self._engine(context)
        if not request_id:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if request_id in self._active:
            await _fail(context, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is running")
        self._active.add(request_id)
        try:
            prompt: PromptType = {"prompt_token_ids": ids, "cache_salt": cache_salt} if cache_salt else ids
            async for out in engine.generate(prompt, params, request_id, priority=priority,
                                             on_added=lambda: context.send_initial_metadata(()),
                                             num_prior_outputs=num_prior_outputs):
                yield out
        except ValueError as e:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await _fail(context, grpc.StatusCode.UNAVAILABLE, f"engine died: {e}")
        except asyncio.CancelledError:  # the client cancelled or the server is stopping
            await asyncio.shield(engine.abort(request_id))
            raise
        finally:
            self._active.discard(request_id)

    async def _engine(self, context: grpc.aio.ServicerContext) -> AsyncLLM:
        engine = self.guard.engine
        if engine is None or not self.guard.serving:
            why = self.guard.reason or "the engine core died"
            await _fail(context, grpc.StatusCode.UNAVAILABLE, f"not serving: {why}")
        return engine


async def _parse(context: grpc.aio.ServicerContext, parse: Callable[[], T]) -> T:
    try:
        return parse()
    except ValueError as e:
        await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """Ends the call with `code` (context.abort raises)."""
    await context.abort(code, message)
    raise AssertionError("unreachable")


class WorkerServer:
    """A running worker: `await start()` (returns once the engine is ready), `await stop()`.
    `gave_up` is set (and `failed` fires) when its engine could not be kept serving."""

    def __init__(self, options: WorkerOptions) -> None:
        o = options
        check_exposure(o.host, o.token, o.tls, o.no_auth)
        self.options = o
        self.guard = EngineGuard(lambda: AsyncLLM(o.engine_config, True), o.guard, self._on_guard)
        self.servicer = WorkerServicer(o.role, self.guard, o.heartbeat_s, o.engine.kv_chunk_size)
        self.health = health.aio.HealthServicer()
        self.metrics: WorkerMetrics | None = None
        self.metrics_port: int | None = None  # the bound port, once started
        self.gave_up: str | None = None
        self.failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._guard_task: asyncio.Task[None] | None = None
        if o.metrics_port is not None:
            self.metrics = WorkerMetrics(o.model_name, o.role, self._stats_for_scrape, instance_id(),
                                         cache_config_labels(o.engine))
        what = f"{o.role} worker"
        checked = ((o.port, what),) if not o.reuse_port else ()
        for port, name in (*checked, (o.metrics_port, f"{what} metrics")):
            if port and not port_free(o.host, port):
                raise PortInUseError(port_in_use_message(o.host, port, name))
        # No SO_REUSEPORT unless asked: gRPC would otherwise let a second worker share a taken port.
        interceptors = [*([TokenInterceptor(o.token)] if o.token else []),
                        *([self.metrics.interceptor] if self.metrics else [])]
        self.server = grpc.aio.server(interceptors=interceptors or None,
                                      options=[("grpc.so_reuseport", int(o.reuse_port)),
                                               *MESSAGE_SIZE_OPTIONS])
        pb_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            address = f"{o.host}:{o.port}"
            self.port = (self.server.add_secure_port(address, server_credentials(o.tls)) if o.tls.enabled
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # taken between the check and the bind
            self.port = 0
        if self.port == 0:
            raise PortInUseError(port_in_use_message(o.host, o.port, what))

    @property
    def target(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        """Listens at once (readiness NOT_SERVING), builds the engine, then reports SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self._loop = asyncio.get_running_loop()
        await self.server.start()
        try:
            if self.metrics is not None and self.options.metrics_port is not None:
                self.metrics_port = self.metrics.start_http(self.options.host, self.options.metrics_port)
            await self.guard.start()
        except BaseException:
            await self.server.stop(None)
            if self.metrics is not None:
                self.metrics.stop_http()
            raise
        self._guard_task = asyncio.create_task(self._watch_engine())
        logger.info("%s worker serving on %s", self.options.role, self.target)

    async def _watch_engine(self) -> None:
        try:
            await self.guard.run()
        except EngineGaveUp as e:
            self.gave_up = str(e)
            logger.error("giving up: %s", e)
            await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.failed.set()

    async def _on_guard(self, serving: bool, reason: str) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING if serving
                               else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting calls, lets in-flight ones finish within the grace period (then
        cancels them, which aborts their requests), and shuts the engine down."""
        if self._guard_task is not None:
            self._guard_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._guard_task
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.options.grace_s if grace_s is None else grace_s)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop_http)
        await self.guard.stop()

    def _stats_for_scrape(self) -> EngineStats | None:
        """Called in the metrics thread: the engine's stats (the snapshot Load shares), fetched
        on the event loop, or None when there is no engine or it does not answer."""
        loop = self._loop
        if self.guard.engine is None or loop is None or loop.is_closed():
            return None
        future = asyncio.run_coroutine_threadsafe(self.servicer.snapshot(SCRAPE_STATS_TIMEOUT_S), loop)
        try:
            return future.result(timeout=SCRAPE_STATS_TIMEOUT_S + 1)
        except Exception as e:  # the loop stopped, or it is stuck
            future.cancel()
            logger.warning("metrics scrape got no engine stats: %r", e)
            return None

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


async def serve(options: WorkerOptions) -> int:
    """Runs a worker until SIGINT / SIGTERM (exit code 0), or until it gives up on its engine
    (1, for its supervisor to restart it); shuts it down gracefully (`pdserve worker`)."""
    import signal

    server = WorkerServer(options)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    print(f"pdserve {options.role} worker listening on {server.target}", flush=True)
    if server.metrics_port is not None:
        print(f"metrics on http://{options.host}:{server.metrics_port}/metrics", flush=True)
    waits = [asyncio.create_task(stopping.wait()), asyncio.create_task(server.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await server.stop(0 if server.gave_up else None)
    if server.gave_up:
        print(f"pdserve {options.role} worker: {server.gave_up}; exiting", file=sys.stderr, flush=True)
        return 1
    return 0
