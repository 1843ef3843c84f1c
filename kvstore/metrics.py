"""Prometheus metrics of one KV store server (its own registry, so several servers can live in
one process, as tests do)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvstore.backend import BackendStats

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.objects = Gauge("pdserve_kvstore_objects", "Objects stored", registry=r)
        self.bytes = Gauge("pdserve_kvstore_bytes", "Bytes stored (metadata + payload)", registry=r)
        self.capacity = Gauge("pdserve_kvstore_capacity_bytes", "Capacity in bytes (0 = unbounded)",
                              registry=r)
        self.hits = Gauge("pdserve_kvstore_hits", "Gets that found their object", registry=r)
        self.misses = Gauge("pdserve_kvstore_misses", "Gets that found nothing", registry=r)
        self.evictions = Gauge("pdserve_kvstore_evictions", "Objects evicted for room", registry=r)
        self.put_objects = Counter("pdserve_kvstore_put_objects", "Objects written", registry=r)
        self.put_bytes = Counter("pdserve_kvstore_put_bytes", "Payload bytes written", registry=r)
        self.get_bytes = Counter("pdserve_kvstore_get_bytes", "Payload bytes read", registry=r)
        # The same-host path (kvstore/shm.py): objects whose payload went as a file, not over
        # the network. Zero for clients on other hosts: what the multi-host test checks.
        self.shm_put_objects = Counter("pdserve_kvstore_shm_put_objects",
                                       "Objects written through shared memory", registry=r)
        self.shm_get_objects = Counter("pdserve_kvstore_shm_get_objects",
                                       "Objects read through shared memory", registry=r)
        self.errors = Counter("pdserve_kvstore_errors", "Rejected calls", ["op"], registry=r)
        self.put_latency = Histogram("pdserve_kvstore_put_seconds", "Put call latency",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.get_latency = Histogram("pdserve_kvstore_get_seconds", "Get call latency",
                                     buckets=_LATENCY_BUCKETS, registry=r)

    def update(self, stats: BackendStats) -> None:
        self.objects.set(stats.objects)
        self.bytes.set(stats.bytes_used)
        self.capacity.set(stats.capacity_bytes)
        self.hits.set(stats.hits)
        self.misses.set(stats.misses)
        self.evictions.set(stats.evictions)

    def exposition(self, stats: BackendStats) -> bytes:
        """Prometheus text format, with the backend's gauges refreshed first."""
        self.update(stats)
        return generate_latest(self.registry)
