"""The router's Prometheus metrics, served at `/metrics`.

Request latencies use vLLM's names (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, token counters, running
requests), measured at the router, so they include dispatch and the KV transfer: what a client
sees. Router-only ones are `pdserve:*`: dispatch decisions, admission rejections, and each worker's
last load report, health and request count (refreshed at scrape time from the pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.pool import WorkerPool

# vLLM's buckets for these histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RouterMetrics:
    def __init__(self, model: str, pools: Iterable[WorkerPool] = ()) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model = model
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, at the router.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output chunks.", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=r).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model)
        self.success = Counter("vllm:request_success", "Finished samples by finish reason.",
                               [*labels, "finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests the router is serving.", labels,
                             registry=r).labels(model)
        self.decisions = Counter("pdserve:router_decisions", "How each sample was dispatched: "
                                 "disaggregated, local_prefill (short uncached part), fallback "
                                 "(prefill failed), colocated.",
                                 ["decision"], registry=r)
        self.rejected = Counter("pdserve:router_rejected", "Requests refused by admission control.",
                                ["reason"], registry=r)
        self.prefill_failures = Counter("pdserve:router_prefill_failures", "Failed prefill calls.",
                                        ["worker"], registry=r)
        self.migrations = Counter("pdserve:router_migrations", "Samples moved to another decode (or "
                                  "colocated) worker mid-stream, by reason: broken (the stream failed), "
                                  "stalled (no output or heartbeat within the stall timeout), unhealthy "
                                  "(the worker went unhealthy).", ["reason"], registry=r)
        self.registry.register(_PoolCollector(list(pools)))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """Each worker's state, read from the pools at scrape time."""

    def __init__(self, pools: list[WorkerPool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = [("pdserve:worker_healthy", "1 while the worker answers (draining or not)."),
                 ("pdserve:worker_draining", "1 while the worker is drained before its removal."),
                 ("pdserve:worker_num_requests_waiting", "Waiting requests, last load report."),
                 ("pdserve:worker_num_requests_running", "Running requests, last load report."),
                 ("pdserve:worker_kv_cache_usage_perc", "KV cache usage [0, 1], last load report."),
                 ("pdserve:worker_requests_inflight", "Requests the router has in flight there."),
                 ("pdserve:worker_requests_dispatched", "Requests the router has sent there.")]
        families = [GaugeMetricFamily(n, h, labels=["worker", "role"]) for n, h in names]
        for pool in self.pools:
            for w in pool.workers:
                load = w.load
                values = [float(w.healthy), float(w.draining),
                          float(load.num_waiting) if load is not None else 0.0,
                          float(load.num_running) if load is not None else 0.0,
                          float(load.kv_usage) if load is not None else 0.0,
                          float(w.inflight), float(w.requests)]
                for fam, v in zip(families, values, strict=True):
                    fam.add_metric([w.target, pool.role], v)
        yield from families
