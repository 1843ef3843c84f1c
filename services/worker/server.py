"""The prefill / decode / colocated gRPC worker process: one AsyncLLM (core in its own process)
behind the `pdserve.worker.v1.Worker` service (services/worker/servicer.py) and the standard
gRPC health service. This module starts and stops it: ports, interceptors, credentials, health,
and the `pdserve worker` entry point (`serve`). With `metrics_port` set, the worker also serves
Prometheus metrics over HTTP (services/worker/metrics.py).

Health tells the truth (engine_guard.py): the engine core is watched, and one that died, froze
or hung is killed and restarted while health says NOT_SERVING. The server listens exclusively
(no SO_REUSEPORT): a second worker on a taken port fails at start with an error naming it.

With a token, every call but health's needs `authorization: Bearer <token>`; with TLS files the
port is TLS (mutual with a client CA). Without either credential a worker listens only on
loopback unless `no_auth` (services/worker/auth.py).

The options (services/worker/options.py) and the servicer are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_llm import AsyncLLM
from engine.connector.keys import key_scheme
from engine.core.outputs import EngineStats
from protos import worker_pb2_grpc as pb_grpc
from services.procs import PortInUseError, instance_id, port_free, port_in_use_message
from services.worker.auth import TokenInterceptor, check_exposure, server_credentials
from services.worker.convert import MESSAGE_SIZE_OPTIONS
from services.worker.edge_checks import MalformedRequests
from services.worker.engine_guard import EngineGaveUp, EngineGuard
from services.worker.metrics import WorkerMetrics, cache_config_labels
from services.worker.options import ROLES, WorkerOptions, WorkerRole
from services.worker.servicer import WorkerServicer

__all__ = ["LIVENESS", "ROLES", "SERVICE_NAME", "WorkerOptions", "WorkerRole", "WorkerServer",
           "WorkerServicer", "serve"]

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.worker.v1.Worker"
# Test hook: the worker waits this many seconds before it builds its engine (a slow model load).
LOAD_DELAY_ENV = "PDSERVE_TEST_LOAD_DELAY_S"
LIVENESS = "liveness"  # health service name of the liveness probe (the others: readiness)
SCRAPE_STATS_TIMEOUT_S = 5.0


class WorkerServer:
    """A running worker: `await start()` (returns once the engine is ready), `await stop()`.
    `gave_up` is set (and `failed` fires) when its engine could not be kept serving."""

    def __init__(self, options: WorkerOptions) -> None:
        o = options
        check_exposure(o.host, o.token, o.tls, o.no_auth)
        self.options = o
        self.guard = EngineGuard(lambda: AsyncLLM(o.engine_config, True), o.guard, self._on_guard)
        self.servicer = WorkerServicer(o.role, self.guard, o.heartbeat_s, o.engine.kv_chunk_size,
                                       key_scheme(o.engine))
        self.health = health.aio.HealthServicer()
        self.metrics: WorkerMetrics | None = None
        self.metrics_port: int | None = None  # the bound port, once started
        self.gave_up: str | None = None
        self.failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._guard_task: asyncio.Task[None] | None = None
        if o.metrics_port is not None:
            self.metrics = WorkerMetrics(o.model_name, o.role, self._stats_for_scrape, instance_id(),
                                         cache_config_labels(o.engine),
                                         restarts=lambda: self.guard.restart_count)
        what = f"{o.role} worker"
        checked = ((o.port, what),) if not o.reuse_port else ()
        for port, name in (*checked, (o.metrics_port, f"{what} metrics")):
            if port and not port_free(o.host, port):
                raise PortInUseError(port_in_use_message(o.host, port, name))
        # No SO_REUSEPORT unless asked: gRPC would otherwise let a second worker share a taken port.
        interceptors = [*([TokenInterceptor(o.token)] if o.token else []),
                        *([self.metrics.interceptor] if self.metrics else []), MalformedRequests()]
        self.server = grpc.aio.server(interceptors=interceptors,
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
            delay = float(os.environ.get(LOAD_DELAY_ENV) or 0)  # a test hook: a model that loads slowly
            if delay > 0:
                logger.warning("%s=%g: the engine starts that late (a test hook)", LOAD_DELAY_ENV, delay)
                await asyncio.sleep(delay)
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
        if self.metrics is not None:
            self.metrics.sync_restarts()  # (collected after this source, in the same scrape)
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
    print(f"pdserve {options.role} worker stopped ({server.target})", flush=True)
    return 0
