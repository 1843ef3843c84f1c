"""The autoscaler loop: every `interval_s`, observe the router, ask the planner, apply its
decisions through an actuator, and record everything.

Scale-up: the actuator starts the workers (in parallel), then each is registered with the router.
Scale-down: the worker with the fewest requests in flight among those the actuator manages is
drained (the router stops sending it requests), waited for until nothing is in flight there, removed
from the router, then stopped: no in-flight request is ever killed. Each decision is logged (one
JSON line, with its reason) and counted in the autoscaler's Prometheus registry; `timeline` keeps
every observation and replica count, for plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.autoscaler.actuators import Actuator
from services.autoscaler.observe import RouterObserver
from services.autoscaler.planner import Decision, Observation, Planner

logger = logging.getLogger(__name__)


@dataclass
class AutoscalerOptions:
    interval_s: float = 5.0
    drain_timeout_s: float = 600.0
    log_path: Path | None = None  # JSON lines: observations and decisions
    decode_role: str = "decode"  # "colocated" when the router runs colocated workers


@dataclass
class Autoscaler:
    observer: RouterObserver
    planner: Planner
    actuator: Actuator
    options: AutoscalerOptions = field(default_factory=AutoscalerOptions)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter("pdserve:autoscaler_decisions", "Scaling decisions.", ["pool", "direction"],
                                 registry=self.registry)
        self.replicas = Gauge("pdserve:autoscaler_replicas", "Workers taking requests, by pool.", ["pool"],
                              registry=self.registry)
        self.starting: dict[str, int] = {"prefill": 0, "decode": 0}
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()  # pools with a change in progress

    async def run(self, stop: asyncio.Event) -> None:
        """Loops until `stop` is set; changes in progress finish (drains included) before it returns."""
        while not stop.is_set():
            try:
                await self.step()
            except Exception as e:  # the router restarting, a worker failing to start...
                logger.warning("autoscaler step failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.interval_s)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def step(self) -> list[Decision]:
        await self._reregister()
        obs = await self.observer.observe(self.starting)
        decisions = [d for d in self.planner.plan(obs) if d.pool not in self._busy]
        self._record(obs, decisions)
        for d in decisions:
            self.decisions.labels(d.pool, "up" if d.delta > 0 else "down").inc()
            self._busy.add(d.pool)
            task = asyncio.get_running_loop().create_task(self._apply(d))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return decisions

    async def _reregister(self) -> None:
        """Registers again the workers of ours the router does not list (a restarted router
        knows only the workers on its command line)."""
        listed = {(w["role"], w["target"]) for w in await self.observer.workers()}
        for role in {"prefill", self.options.decode_role}:
            for target in self.actuator.managed(role):
                if (role, target) not in listed and not self._busy:
                    logger.warning("autoscaler: the router does not list %s worker %s; registering it",
                                   role, target)
                    reply = await self.observer.http.post(f"{self.observer.url}/admin/workers",
                                                          json={"role": role, "target": target})
                    reply.raise_for_status()

    def _record(self, obs: Observation, decisions: list[Decision]) -> None:
        self.replicas.labels("prefill").set(obs.prefill_workers)
        self.replicas.labels("decode").set(obs.decode_workers)
        row = {"wall": time.time(), **asdict(obs), "decisions": [asdict(d) for d in decisions]}
        self.timeline.append(row)
        for d in decisions:
            logger.warning("autoscaler: %s %d -> %d: %s", d.pool, d.current, d.target, d.reason)
        if self.options.log_path is not None:
            with open(self.options.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    async def _apply(self, d: Decision) -> None:
        role = self.options.decode_role if d.pool == "decode" else "prefill"
        try:
            if d.delta > 0:
                await asyncio.gather(*(self._add(d.pool, role) for _ in range(d.delta)))
            else:
                for _ in range(-d.delta):
                    await self._remove(role)
        except Exception as e:
            logger.warning("autoscaler: applying %s %d -> %d failed: %s", d.pool, d.current, d.target, e)
        finally:
            self._busy.discard(d.pool)

    async def _add(self, pool: str, role: str) -> None:
        self.starting[pool] += 1
        try:
            target = await self.actuator.start(role)
            reply = await self.observer.http.post(f"{self.observer.url}/admin/workers",
                                                  json={"role": role, "target": target})
            reply.raise_for_status()
            # counted as starting until the router's first load report marks it healthy
            for _ in range(50):
                if any(w["target"] == target and w["healthy"] for w in await self.observer.workers()):
                    break
                await asyncio.sleep(0.1)
        finally:
            self.starting[pool] -= 1

    async def _remove(self, role: str) -> None:
        workers = {w["target"]: w for w in await self.observer.workers() if w["role"] == role}
        mine = [t for t in self.actuator.managed(role) if t in workers and not workers[t]["draining"]]
        if not mine:
            logger.warning("autoscaler: no %s worker of mine to remove", role)
            return
        await self.remove(role, min(mine, key=lambda t: workers[t]["inflight"]))

    async def remove(self, role: str, target: str) -> None:
        """Drains `target` in the router, waits until nothing is in flight there, removes it from
        the router, then stops it. When the router cannot be reached the worker is still stopped
        (its own shutdown drains what it has)."""
        http, url = self.observer.http, f"{self.observer.url}/admin/workers"
        try:
            (await http.post(f"{url}/drain", json={"role": role, "target": target})).raise_for_status()
            deadline = time.monotonic() + self.options.drain_timeout_s
            while True:
                reply = await http.post(f"{url}/remove", json={"role": role, "target": target})
                if reply.status_code == 200:
                    break
                if reply.status_code != 409 or time.monotonic() > deadline:
                    raise RuntimeError(f"removing {target}: {reply.status_code} {reply.text[:200]}")
                await asyncio.sleep(0.2)
        except httpx.HTTPError as e:
            logger.warning("autoscaler: router unreachable while removing %s (%s); stopping it", target, e)
        await self.actuator.stop(role, target)
