"""The workers of one role (prefill, or decode / colocated) as the router sees them: their last load
report, their health, the requests the router has sent them, and a prefix index each.

A background task asks every worker for its load every `refresh_s` (with a timeout). A worker that
cannot be reached (Load or a request failing with UNAVAILABLE, `mark_failed`) is unhealthy at once;
one whose reports time out `missed_reports_unhealthy` times in a row (hung) is too; an unhealthy
worker gets no requests until a Load succeeds again. Picking never waits on the network.

Targets are host:port, or dns:host:port for every address a name resolves to (compose replicas,
a Kubernetes headless service), re-resolved every `resolve_s`: new addresses join, vanished ones
are drained and removed.

Policies:
- "least_loaded": vLLM's score, waiting * 4 + running, from the last report plus the requests sent
  since that report (so a burst between two reports spreads out).
- "prefix_aware": among the workers whose score is within `balance_slack` of the least loaded,
  the one whose prefix index matches the most leading prompt blocks (ties: least loaded). A hot
  prefix stays on one worker until that worker is `balance_slack` busier than the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from protos import worker_pb2 as pb
from services.router.prefix_index import PrefixIndex
from services.worker.client import WorkerClient

logger = logging.getLogger(__name__)

Policy = Literal["least_loaded", "prefix_aware"]
POLICIES: tuple[Policy, ...] = ("least_loaded", "prefix_aware")


Resolver = Callable[[str, int], Awaitable[list[str]]]
DNS_PREFIX = "dns:"


def load_score(load: pb.LoadReport) -> int:
    return int(load.num_waiting) * 4 + int(load.num_running)


@dataclass(frozen=True)
class PoolOptions:
    policy: Policy = "prefix_aware"
    refresh_s: float = 0.1  # how often each worker's load is asked for
    load_timeout_s: float = 1.0
    resolve_s: float = 2.0  # how often `dns:` targets are resolved again
    balance_slack: float = 4.0  # score a worker may exceed the least loaded by and still win on prefix
    missed_reports_unhealthy: int = 5  # late load reports in a row that mark a worker unhealthy
    block_size: int = 16  # the workers' KV block size (prefix index granularity)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if self.refresh_s <= 0 or self.load_timeout_s <= 0 or self.balance_slack < 0:
            raise ValueError("refresh_s and load_timeout_s must be > 0 and balance_slack >= 0")


@dataclass
class WorkerState:
    client: WorkerClient
    prefix: PrefixIndex
    healthy: bool = True  # optimistic until the first report says otherwise
    draining: bool = False  # gets no new requests; removed once its in-flight ones ended
    load: pb.LoadReport | None = None
    sent_since_report: int = 0
    inflight: int = 0  # router-side: dispatched and not finished
    requests: int = 0  # dispatched in all
    failures: int = 0
    missed_reports: int = 0  # load reports in a row that failed or came late
    last_error: str = ""

    @property
    def target(self) -> str:
        return self.client.target

    @property
    def unreported(self) -> int:
        """Requests sent since the last load report that are still in flight (at most): the
        ones that already finished must not count, or a late report would let the estimate grow
        without bound under a fast stream of short requests."""
        return min(self.sent_since_report, self.inflight)

    @property
    def score(self) -> float:
        reported = load_score(self.load) if self.load is not None else 0
        return reported + self.unreported

    @property
    def waiting(self) -> int:
        """Requests likely queued on the worker: reported waiting plus those sent since."""
        return (int(self.load.num_waiting) if self.load is not None else 0) + self.unreported


@dataclass(frozen=True)
class Pick:
    worker: WorkerState
    matched_tokens: int  # prompt tokens the worker has likely cached


class WorkerPool:
    def __init__(self, role: str, targets: Sequence[str], options: PoolOptions = PoolOptions(),
                 resolver: Resolver | None = None) -> None:
        self.role = role
        self.options = options
        self.workers = [WorkerState(WorkerClient(t), PrefixIndex(options.block_size))
                        for t in targets if not t.startswith(DNS_PREFIX)]
        # "dns:host:port" targets: every address the name resolves to is a worker (compose
        # replicas, a Kubernetes headless service); re-resolved every resolve_s.
        self.names = [t.removeprefix(DNS_PREFIX) for t in targets if t.startswith(DNS_PREFIX)]
        self._found: dict[str, set[str]] = {name: set() for name in self.names}
        self._discovered: set[str] = set()  # every address a name ever resolved to
        self._resolver = resolver or _getaddrinfo
        self._resolved_at = -math.inf
        self._task: asyncio.Task[None] | None = None

    # --- background refresh -------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.gather(*(w.client.close() for w in self.workers))

    async def _refresh_forever(self) -> None:
        while True:
            if self.names and time.monotonic() - self._resolved_at >= self.options.resolve_s:
                await self.resolve()
            await self.refresh()
            await asyncio.sleep(self.options.refresh_s)

    async def resolve(self) -> None:
        """Adds the addresses the `dns:` names resolve to; drains vanished ones and removes them
        once nothing is in flight there. A name that fails to resolve keeps its last addresses."""
        self._resolved_at = time.monotonic()
        for name in self.names:
            host, _, port = name.rpartition(":")
            try:
                found = {_join(ip, port) for ip in await self._resolver(host, int(port))}
            except OSError as e:
                logger.warning("%s pool: resolving %s failed: %s", self.role, name, e)
                continue
            for target in sorted(found - self._found[name]):
                self.add(target)
                self._discovered.add(target)
            for target in self._found[name] - found:
                self.drain(target)
            self._found[name] = found
        current = set().union(*self._found.values())
        for w in [w for w in self.workers if w.draining and w.inflight == 0]:
            if w.target not in current and w.target in self._discovered:
                await self.remove(w.target)

    async def refresh(self) -> None:
        """Asks every worker for its load once; updates health."""
        await asyncio.gather(*(self._refresh_one(w) for w in self.workers))

    async def _refresh_one(self, w: WorkerState) -> None:
        try:
            load = await asyncio.wait_for(w.client.load(), self.options.load_timeout_s)
        except (grpc.RpcError, TimeoutError) as e:
            w.missed_reports += 1
            # Unreachable: at once. Slow (a busy worker answers late): after a few in a row.
            if is_down(e) or w.missed_reports >= self.options.missed_reports_unhealthy:
                self._set_unhealthy(w, f"load report failed: {_describe(e)}")
            return
        w.load, w.sent_since_report, w.missed_reports = load, 0, 0
        if not w.healthy:
            logger.warning("%s worker %s is healthy again", self.role, w.target)
            w.healthy, w.last_error = True, ""

    def mark_failed(self, w: WorkerState, error: BaseException) -> None:
        """A call to the worker failed in a way that says it is down (UNAVAILABLE, connection)."""
        w.failures += 1
        self._set_unhealthy(w, _describe(error))

    def _set_unhealthy(self, w: WorkerState, why: str) -> None:
        if w.healthy:
            logger.warning("%s worker %s marked unhealthy: %s", self.role, w.target, why)
            w.prefix.clear()  # a restarted worker has an empty cache
        w.healthy, w.last_error = False, why

    # --- choosing -----------------------------------------------------------------------------
    @property
    def healthy(self) -> list[WorkerState]:
        """The workers that take new requests: healthy and not draining."""
        return [w for w in self.workers if w.healthy and not w.draining]

    # --- membership (the autoscaler's actuators call these through the router's admin API) ----
    def find(self, target: str) -> WorkerState | None:
        return next((w for w in self.workers if w.target == target), None)

    def add(self, target: str) -> WorkerState:
        """Adds a worker (or stops draining a known one); it takes requests after its first report."""
        w = self.find(target)
        if w is None:
            w = WorkerState(WorkerClient(target), PrefixIndex(self.options.block_size), healthy=False)
            self.workers.append(w)
            logger.warning("%s worker %s added", self.role, target)
            if self._task is not None:
                asyncio.get_running_loop().create_task(self._refresh_one(w))
        w.draining = False
        return w

    def drain(self, target: str) -> WorkerState | None:
        """Stops sending new requests to the worker; in-flight ones go on."""
        w = self.find(target)
        if w is not None and not w.draining:
            w.draining = True
            logger.warning("%s worker %s draining (%d in flight)", self.role, target, w.inflight)
        return w

    async def remove(self, target: str, force: bool = False) -> bool:
        """Removes a drained worker once it has nothing in flight (or at once with `force`).
        Returns False when it still has requests in flight."""
        w = self.find(target)
        if w is None:
            return True
        if w.inflight and not force:
            return False
        self.workers.remove(w)
        await w.client.close()
        logger.warning("%s worker %s removed", self.role, target)
        return True

    def saturated(self, max_waiting: int) -> bool:
        """True when every worker taking requests already has `max_waiting` or more queued."""
        healthy = self.healthy
        return bool(healthy) and all(w.waiting >= max_waiting for w in healthy)

    def pick(self, hashes: Sequence[int] = (), exclude: frozenset[str] = frozenset()) -> Pick | None:
        """The worker for a prompt whose block hashes are `hashes`; None when none is healthy."""
        cands = [w for w in self.workers if w.healthy and not w.draining and w.target not in exclude]
        if not cands:
            return None
        best = min(w.score for w in cands)
        if self.options.policy == "least_loaded" or not hashes:
            w = min(cands, key=lambda w: (w.score, w.inflight))
            return Pick(w, w.prefix.match(hashes))
        near = [w for w in cands if w.score <= best + self.options.balance_slack]
        matches = {w.target: w.prefix.match(hashes) for w in near}
        w = min(near, key=lambda w: (-matches[w.target], w.score, w.inflight))
        return Pick(w, matches[w.target])

    def acquire(self, w: WorkerState, hashes: Sequence[int] = ()) -> None:
        w.inflight += 1
        w.requests += 1
        w.sent_since_report += 1
        if hashes:
            w.prefix.insert(hashes)

    def release(self, w: WorkerState) -> None:
        w.inflight -= 1


def is_down(error: BaseException) -> bool:
    """Whether a failed call says the worker is unreachable (as opposed to a bad request)."""
    if isinstance(error, grpc.RpcError):
        code = error.code() if callable(getattr(error, "code", None)) else None
        return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    return isinstance(error, ConnectionError | OSError) and not isinstance(error, TimeoutError)


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _join(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "details", None)):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"

