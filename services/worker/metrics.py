"""Prometheus metrics of one worker (`pdserve worker --metrics-port N`, GET /metrics).

Engine metrics are read at scrape time: `EngineStatsCollector` asks for one `EngineStats`
snapshot (queues, KV cache, counters and histograms kept by the engine core since start-up) and
turns it into metric families, so a scrape costs one stats round trip to the core and nothing is
kept here. Names follow vLLM where it has one (`vllm:num_requests_running`, ...); the rest are
`pdserve:*`. Every sample carries `model_name` and `role`. RPC counts come from a server
interceptor. The HTTP endpoint runs in prometheus_client's own thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.outputs import EngineStats, Histogram

logger = logging.getLogger(__name__)

WORKER_SERVICE_PREFIX = "/pdserve.worker.v1.Worker/"
StatsSource = Callable[[], EngineStats | None]  # None: no engine (starting, dead, or too slow)


class EngineStatsCollector(Collector):
    """Metric families from one `EngineStats` snapshot per scrape."""

    def __init__(self, labels: dict[str, str], stats: StatsSource) -> None:
        self._names = list(labels)
        self._values = list(labels.values())
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield self._gauge("pdserve:engine_up", "1 when the engine answered this scrape, else 0.",
                          0.0 if stats is None else 1.0)
        if stats is None:
            return
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                          stats.kv_usage)
        yield self._gauge("pdserve:kv_cache_free_blocks", "KV cache blocks free.",
                          stats.num_free_blocks)
        yield self._gauge("pdserve:kv_cache_total_blocks", "Usable KV cache blocks.",
                          stats.num_total_blocks)
        yield self._gauge("pdserve:prefix_cache_blocks",
                          "Full blocks findable in the prefix cache (in use or free).",
                          stats.num_cached_blocks)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.prefix_cache_hits)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a token.",
                            stats.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield self._counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.",
                            stats.num_preemptions)
        step = HistogramMetricFamily("pdserve:engine_step_seconds",
                                     "Duration of engine steps that computed tokens (schedule, "
                                     "forward, update).", labels=self._names)
        _add_histogram(step, self._values, stats.step_seconds)
        yield step
        yield from self._transfer_metrics(stats)

    def _transfer_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        kv = stats.kv_transfer
        if kv is None:  # no KV connector (colocated)
            return
        names = [*self._names, "direction"]
        seconds = HistogramMetricFamily(
            "pdserve:kv_transfer_seconds", "KV connector transfers: a load is one request's KV "
            "arriving from the KV store, a save is one put of KV objects to it.", labels=names)
        nbytes = CounterMetricFamily("pdserve:kv_transfer_bytes",
                                     "KV payload bytes moved to (save) or from (load) the KV store.",
                                     labels=names)
        failures = CounterMetricFamily("pdserve:kv_transfer_failures",
                                       "KV loads that ended short or failed, saves that failed.",
                                       labels=names)
        for direction, hist, moved, failed in (
                ("load", kv.load_seconds, kv.load_bytes, kv.load_failures),
                ("save", kv.save_seconds, kv.save_bytes, kv.save_failures)):
            _add_histogram(seconds, [*self._values, direction], hist)
            nbytes.add_metric([*self._values, direction], moved)
            failures.add_metric([*self._values, direction], failed)
        yield from (seconds, nbytes, failures)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family


def _add_histogram(family: HistogramMetricFamily, labels: list[str], hist: Histogram) -> None:
    buckets = [("+Inf" if math.isinf(bound) else repr(bound), count)
               for bound, count in hist.cumulative()]
    family.add_metric(labels, buckets, hist.total)


class RpcCountingInterceptor(grpc.aio.ServerInterceptor):
    """Counts Worker RPCs by method and final status code (health checks are not counted)."""

    def __init__(self, count: Callable[[str, grpc.StatusCode], None]) -> None:
        self._count = count

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        name: str = handler_call_details.method
        if handler is None or not name.startswith(WORKER_SERVICE_PREFIX):
            return handler
        method = name.removeprefix(WORKER_SERVICE_PREFIX)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream), handler.request_deserializer,
                handler.response_serializer)
        return handler

    def _unary(self, method: str, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                response = await behavior(request, context)
            except BaseException as e:
                self._count(method, _status_of(e, context))
                raise
            self._count(method, _status_of(None, context))
            return response

        return wrapped

    def _stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]
                ) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                self._count(method, _status_of(e, context))
                raise
            self._count(method, _status_of(None, context))

        return wrapped


def _status_of(error: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()  # set by context.abort / set_code
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class WorkerMetrics:
    """One worker's registry: engine stats at scrape time, RPC counts; `start_http` serves it."""

    def __init__(self, model_name: str, role: str, stats: StatsSource) -> None:
        labels = {"model_name": model_name, "role": role}
        self._labels = labels
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(labels, stats))
        self.rpcs = Counter("pdserve:worker_rpcs", "Worker RPCs finished, by method and status code.",
                            [*labels, "method", "code"], registry=self.registry)
        self.interceptor = RpcCountingInterceptor(self.count_rpc)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def count_rpc(self, method: str, code: grpc.StatusCode) -> None:
        self.rpcs.labels(**self._labels, method=method, code=code.name).inc()

    def start_http(self, host: str, port: int) -> int:
        """Serves GET /metrics on host:port (0 = any free port) in a thread; returns the port."""
        if self._http is not None:
            raise RuntimeError("the metrics endpoint is already running")
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http[0].server_port)

    def stop_http(self) -> None:
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
