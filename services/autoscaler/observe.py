"""What the planner sees, read from the router: its /metrics (TTFT and ITL histograms, prompt-token
and request counters) and /admin/workers (each worker's role, health, draining state and last load
report). Percentiles come from the histogram buckets that filled during the interval (linear
inside a bucket, as Prometheus' histogram_quantile does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.autoscaler.planner import Observation


@dataclass
class _Sample:
    time_s: float
    counters: dict[str, float]
    buckets: dict[str, list[tuple[float, float]]]  # histogram -> [(le, cumulative count)]


def quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """The q-quantile of what fell into the buckets between two scrapes (seconds), or None."""
    prev = dict(before)
    deltas = [(le, count - prev.get(le, 0.0)) for le, count in sorted(after)]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, cum in deltas:
        if cum >= rank:
            if le == float("inf"):
                return lo  # past the last finite bucket: its lower edge is all we know
            width = cum - below
            return lo + (le - lo) * ((rank - below) / width if width > 0 else 1.0)
        lo, below = le, cum
    return lo


MIN_BUSY_S = 0.5  # busy seconds in an interval for a throughput reading


class RouterObserver:
    """`await observer.observe(starting={"prefill": 1})` -> an Observation of the last interval."""

    HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")
    COUNTERS = ("vllm:prompt_tokens_total", "vllm:request_success_total")

    def __init__(self, router_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        self.url = router_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self._last: _Sample | None = None
        self._busy: dict[str, tuple[float, float]] = {}  # prefill target -> (prompt tokens, busy s)

    async def close(self) -> None:
        await self.http.aclose()

    async def workers(self) -> list[dict[str, Any]]:
        reply = await self.http.get(f"{self.url}/admin/workers")
        reply.raise_for_status()
        return list(reply.json()["workers"])

    async def _sample(self) -> _Sample:
        reply = await self.http.get(f"{self.url}/metrics")
        reply.raise_for_status()
        counters: dict[str, float] = {}
        buckets: dict[str, list[tuple[float, float]]] = {h: [] for h in self.HISTOGRAMS}
        for family in text_string_to_metric_families(reply.text):
            for s in family.samples:
                if s.name in self.COUNTERS:
                    counters[s.name] = counters.get(s.name, 0.0) + s.value
                base = s.name.removesuffix("_bucket")
                if s.name.endswith("_bucket") and base in buckets:
                    buckets[base].append((float(s.labels["le"]), s.value))
        return _Sample(time.monotonic(), counters, buckets)

    async def observe(self, starting: dict[str, int] | None = None) -> Observation:
        """The last interval (since the previous call); `starting` counts workers on their way
        up, so the planner does not ask for them twice."""
        sample, workers = await self._sample(), await self.workers()
        last, self._last = self._last, sample
        starting = starting or {}
        live = [w for w in workers if w["healthy"] and not w["draining"]]
        prefill = [w for w in live if w["role"] == "prefill"]
        decode = [w for w in live if w["role"] in ("decode", "colocated")]
        dt = (sample.time_s - last.time_s) if last else 0.0

        def rate(name: str) -> float:
            if not last or dt <= 0:
                return 0.0
            return max(0.0, sample.counters.get(name, 0.0) - last.counters.get(name, 0.0)) / dt

        def p90_ms(name: str) -> float | None:
            if not last:
                return None
            value = quantile(0.9, last.buckets[name], sample.buckets[name])
            return None if value is None else value * 1e3

        return Observation(
            prefill_busy_tokens_per_s=self._busy_throughput(prefill),
            time_s=sample.time_s,
            prefill_workers=len(prefill) + starting.get("prefill", 0),
            decode_workers=len(decode) + starting.get("decode", 0),
            prompt_tokens_per_s=rate("vllm:prompt_tokens_total"),
            requests_per_s=rate("vllm:request_success_total"),
            ttft_p90_ms=p90_ms("vllm:time_to_first_token_seconds"),
            itl_p90_ms=p90_ms("vllm:inter_token_latency_seconds"),
            prefill_waiting=sum(int(w["waiting"]) for w in prefill),
            decode_running=sum(int(w["running"]) for w in decode),
            decode_waiting=sum(int(w["waiting"]) for w in decode))

    def _busy_throughput(self, prefill: list[dict[str, Any]]) -> float | None:
        """Prompt tokens per busy second of the prefill workers over the interval (their engines'
        own counters), or None when they were busy for under MIN_BUSY_S in all: an idle interval
        says nothing about capacity."""
        now = {w["target"]: (float(w.get("prompt_tokens", 0)), float(w.get("busy_seconds", 0.0)))
               for w in prefill}
        tokens = busy = 0.0
        for target, (t, b) in now.items():
            if target in self._busy:
                t0, b0 = self._busy[target]
                if b >= b0 and t >= t0:  # a restarted worker's counters start again from zero
                    tokens, busy = tokens + t - t0, busy + b - b0
        self._busy = now
        return tokens / busy if busy >= MIN_BUSY_S and tokens > 0 else None
