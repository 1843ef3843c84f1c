"""The workers of one role (prefill, or decode / colocated) as the router sees them: their last load
report, their health, the requests the router has sent them, and a prefix index each.

A background task asks every worker for its load every `refresh_s` (with a timeout). A worker that
cannot be reached (Load or a request failing with UNAVAILABLE, `mark_failed`) is unhealthy at once;
one whose report says it does not serve (its engine core is down, frozen or restarting) is too;
so is one whose reports time out `missed_reports_unhealthy` times in a row (frozen, hung). An
unhealthy worker gets no requests until a report says it serves again; `on_unhealthy(worker,
why, down)` is told at once (`down`: unreachable, not merely slow or not ready; the dispatcher
moves the calls in flight there elsewhere). A report with
a new instance id means the worker restarted: what the pool knew of its cache is forgotten.
Picking never waits on the network.

Targets are host:port, or dns:host:port for every address a name resolves to (compose replicas,
a Kubernetes headless service), re-resolved every `resolve_s`: new addresses join, vanished ones
are drained and removed.

Policies:
- "least_loaded": vLLM's score, waiting * 4 + running, from the last report plus the requests sent
  since that report (so a burst between two reports spreads out).
- "prefix_aware": cache overlap weighed against load, both in tokens (as Dynamo's KV router and
  llm-d's scorers weigh them): the worker with the lowest
      overlap_weight * (prompt tokens it has likely not cached) + (tokens of work it holds),
  where the work held is its KV blocks in use plus, for each request queued there or sent since
  its last report, one prompt's worth. A shared prefix (a chat template's system prompt) saves
  its tokens on the worker that has it, and no more: once that worker holds more work than the
  prefix saves, the next request goes elsewhere, and a new or restarted worker (no work held)
  takes requests as soon as its first report says it serves.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from protos import worker_pb2 as pb
from services.router.dispatch.background import Background
from services.router.dispatch.kv_events import KVEventFeed, subscriber_address
from services.router.dispatch.prefix_index import PrefixIndex
from services.router.dispatch.worker_state import WorkerState
from services.worker.auth import WorkerAccess
from services.worker.client import WorkerClient, WorkerError

logger = logging.getLogger(__name__)

Policy = Literal["least_loaded", "prefix_aware"]
POLICIES: tuple[Policy, ...] = ("least_loaded", "prefix_aware")
PrefixSource = Literal["events", "approximate"]
PREFIX_SOURCES: tuple[PrefixSource, ...] = ("events", "approximate")


Resolver = Callable[[str, int], Awaitable[list[str]]]
DNS_PREFIX = "dns:"


@dataclass(frozen=True)
class PoolOptions:
    policy: Policy = "prefix_aware"
    refresh_s: float = 0.1  # how often each worker's load is asked for
    load_timeout_s: float = 1.0
    resolve_s: float = 2.0  # how often `dns:` targets are resolved again
    overlap_weight: float = 1.0  # prefix_aware: what a cached prompt token is worth in held tokens
    missed_reports_unhealthy: int = 5  # late load reports in a row that mark a worker unhealthy
    block_size: int = 16  # the workers' KV block size (prefix index granularity)
    # "events": a worker that publishes KV cache events is scored on the blocks it holds
    # (dispatch/kv_events.py), the others and any whose stream is missing or behind on the
    # approximate index; "approximate": the approximate index only
    prefix_index: PrefixSource = "events"
    access: WorkerAccess | None = None  # token and TLS files of the channels; None = from the env

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if self.prefix_index not in PREFIX_SOURCES:
            raise ValueError(f"prefix_index: must be one of {PREFIX_SOURCES}, got {self.prefix_index!r}")
        if self.refresh_s <= 0 or self.load_timeout_s <= 0 or self.overlap_weight < 0:
            raise ValueError("refresh_s and load_timeout_s must be > 0 and overlap_weight >= 0")


@dataclass(frozen=True)
class Pick:
    worker: WorkerState
    matched_tokens: int  # prompt tokens the worker has likely cached


class WorkerPool:
    def __init__(self, role: str, targets: Sequence[str], options: PoolOptions = PoolOptions(),
                 resolver: Resolver | None = None,
                 on_unhealthy: Callable[[WorkerState, str, bool], None] | None = None) -> None:
        self.role = role
        self.options = options
        self.on_unhealthy = on_unhealthy
        self.access = options.access if options.access is not None else WorkerAccess.from_env()
        self.workers = [WorkerState(WorkerClient(t, self.access), PrefixIndex(options.block_size))
                        for t in targets if not t.startswith(DNS_PREFIX)]
        # "dns:host:port" targets: every address the name resolves to is a worker (compose
        # replicas, a Kubernetes headless service); re-resolved every resolve_s.
        self.names = [t.removeprefix(DNS_PREFIX) for t in targets if t.startswith(DNS_PREFIX)]
        self._found: dict[str, set[str]] = {name: set() for name in self.names}
        self._discovered: set[str] = set()  # every address a name ever resolved to
        self._resolver = resolver or _getaddrinfo
        self._resolved_at = -math.inf
        self._refresher = Background(self._refresh_forever)
        self._closes: set[asyncio.Task[None]] = set()

    # --- background refresh -------------------------------------------------------------------
    def start(self) -> None:
        self._refresher.start()

    async def close(self) -> None:
        await self._refresher.stop()
        await asyncio.gather(*(w.client.close() for w in self.workers),
                             *(w.feed.close() for w in self.workers if w.feed is not None))

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
                self.add(target, server_name=host)
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
        # Requests that end while the report is in flight may still be in it: their KV comes
        # off once it arrives (a request that ended after the worker computed it comes off too:
        # an underestimate until the next report, never an idle worker that looks busy).
        w.asking, w.freed_since_ask = True, 0
        try:
            load = await asyncio.wait_for(w.client.load(), self.options.load_timeout_s)
        except (WorkerError, TimeoutError) as e:
            w.asking = False
            w.missed_reports += 1
            # Unreachable: at once. Slow (a busy worker answers late): after a few in a row.
            if is_down(e) or w.missed_reports >= self.options.missed_reports_unhealthy:
                self._set_unhealthy(w, f"load report failed: {_describe(e)}", down=is_down(e))
            return
        w.load, w.sent_since_report, w.missed_reports = load, 0, 0
        w.counted_upto, w.freed_since_report = w.requests, w.freed_since_ask
        w.asking, w.freed_since_ask = False, 0
        w.reported_at = time.monotonic()
        if load.instance_id != w.instance:
            if w.instance:
                logger.warning("%s worker %s restarted (new instance)", self.role, w.target)
                w.forget_cache()
            w.instance = load.instance_id
        self._follow_events(w, load)
        if not load.serving:  # its own requests fail by themselves if they are lost
            self._set_unhealthy(w, f"not serving: {load.not_serving_reason}", down=False)
        elif not w.healthy:
            logger.warning("%s worker %s is healthy again", self.role, w.target)
            w.healthy, w.last_error = True, ""

    def _follow_events(self, w: WorkerState, load: pb.LoadReport) -> None:
        """Subscribes to the worker's KV events where its report says it publishes them (and
        stops where it no longer does, or the worker left the pool while its report was on its
        way)."""
        wanted = (self.options.prefix_index == "events" and bool(load.kv_events_endpoint)
                  and w in self.workers)
        endpoint = subscriber_address(load.kv_events_endpoint, w.target)
        replay = subscriber_address(load.kv_events_replay_endpoint, w.target)
        feed = w.feed
        if feed is not None and (not wanted or (feed.endpoint, feed.replay_endpoint, feed.topic)
                                 != (endpoint, replay, load.kv_events_topic)):
            self._closing(feed)
            feed = w.feed = None
        if not wanted:
            return
        if feed is None:
            feed = w.feed = KVEventFeed(f"{self.role} worker {w.target}", endpoint, replay,
                                        load.kv_events_topic)
            feed.start()
        feed.reported(int(load.kv_events_published), load.kv_events_epoch)

    def _closing(self, feed: KVEventFeed) -> None:
        task = asyncio.get_running_loop().create_task(feed.close())
        self._closes.add(task)  # (held until done: the loop keeps only weak references)
        task.add_done_callback(self._closes.discard)

    def mark_failed(self, w: WorkerState, error: BaseException) -> None:
        """A call to the worker failed in a way that says it is down (UNAVAILABLE, connection)."""
        w.failures += 1
        self._set_unhealthy(w, _describe(error), down=True)

    def _set_unhealthy(self, w: WorkerState, why: str, down: bool) -> None:
        was = w.healthy
        if was:
            logger.warning("%s worker %s marked unhealthy: %s", self.role, w.target, why)
            w.forget_cache()  # a restarted worker has an empty cache
        w.healthy, w.last_error = False, why
        if was and self.on_unhealthy is not None:
            self.on_unhealthy(w, why, down)

    # --- choosing -----------------------------------------------------------------------------
    @property
    def healthy(self) -> list[WorkerState]:
        """The workers that take new requests: healthy and not draining."""
        return [w for w in self.workers if w.healthy and not w.draining]

    # --- membership (the autoscaler's actuators call these through the router's admin API) ----
    def find(self, target: str) -> WorkerState | None:
        return next((w for w in self.workers if w.target == target), None)

    def add(self, target: str, server_name: str | None = None) -> WorkerState:
        """Adds a worker (or stops draining a known one); it takes requests after its first report.
        `server_name`: the name `target` was resolved from (its TLS certificate names that)."""
        w = self.find(target)
        if w is None:
            w = WorkerState(WorkerClient(target, self.access, server_name),
                            PrefixIndex(self.options.block_size), healthy=False)
            self.workers.append(w)
            logger.warning("%s worker %s added", self.role, target)
            if self._refresher.running:
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
        if w.feed is not None:
            await w.feed.close()
        logger.warning("%s worker %s removed", self.role, target)
        return True

    def shared_tp_size(self) -> int | None:
        """The tensor-parallel size every worker taking requests reports; None when they differ or
        none takes requests. A worker that has not reported yet counts as 1 while every report so
        far says 1 (a pool without tensor parallelism hands off early from its first request);
        beside a larger reported size it makes the size unknown (None)."""
        healthy = self.healthy
        sizes = {w.tp_size for w in healthy if w.load is not None}
        if any(w.load is None for w in healthy):
            if sizes - {1}:
                return None
            sizes.add(1)
        return sizes.pop() if len(sizes) == 1 else None

    def saturated(self, max_waiting: int) -> bool:
        """True when every worker taking requests already has `max_waiting` or more queued."""
        healthy = self.healthy
        return bool(healthy) and all(w.waiting >= max_waiting for w in healthy)

    def pick(self, hashes: Sequence[bytes] = (), exclude: frozenset[str] = frozenset(),
             prompt_tokens: int = 0) -> Pick | None:
        """The worker for a prompt of `prompt_tokens` tokens whose block hashes are `hashes`;
        None when none is healthy (or all are in `exclude`)."""
        cands = [w for w in self.workers if w.healthy and not w.draining and w.target not in exclude]
        if not cands:
            return None
        if self.options.policy == "least_loaded" or not hashes:
            w = min(cands, key=lambda w: (w.score, w.inflight))
            return Pick(w, w.match(self._hittable(hashes, prompt_tokens), self.options.block_size))
        bs, weight = self.options.block_size, self.options.overlap_weight
        tokens = max(prompt_tokens, len(hashes) * bs)
        hittable = self._hittable(hashes, prompt_tokens)
        matches = {w.target: w.match(hittable, bs) for w in cands}

        def cost(w: WorkerState) -> tuple[float, int]:
            uncached = tokens - matches[w.target]
            return weight * uncached + w.held_tokens(bs, tokens), w.inflight

        w = min(cands, key=cost)
        return Pick(w, matches[w.target])

    def _hittable(self, hashes: Sequence[bytes], prompt_tokens: int) -> Sequence[bytes]:
        """The blocks a prompt of `prompt_tokens` tokens can find cached: the engine computes at
        least its last token, so a prompt of whole blocks hits one block fewer."""
        if prompt_tokens <= 0:
            return hashes
        return hashes[:max(0, (prompt_tokens - 1) // self.options.block_size)]

    def acquire(self, w: WorkerState, hashes: Sequence[bytes] = (), prompt_tokens: int = 0) -> Lease:
        """Counts a request sent to `w` whose prompt's block hashes are `hashes`; `release` it
        with the lease when it ends."""
        w.inflight += 1
        w.requests += 1
        w.sent_since_report += 1
        if not hashes:
            return Lease(w, w.requests, 0)
        hittable = self._hittable(hashes, prompt_tokens)
        exact = w.match(hittable, self.options.block_size) if w.exact else None
        approximate = w.prefix.insert(hashes)  # (kept up to date: the fallback)
        if exact is None:
            return Lease(w, w.requests, min(approximate, len(hittable) * self.options.block_size))
        return Lease(w, w.requests, exact, exact=True)

    def release(self, lease: Lease, tokens: int = 0) -> None:
        """The request ended, having held `tokens` tokens of KV (prompt and output) on the worker
        (0: it never ran there). When the last load report may have counted it (it was
        dispatched before that report arrived), or a report is in flight, its own blocks come
        off the worker's held work until the next report: whole blocks, less the prefix it found
        cached (which other requests may still use)."""
        w = lease.worker
        w.inflight -= 1
        if tokens <= 0:
            return
        bs = self.options.block_size
        own = max(0, -(-tokens // bs) * bs - lease.matched_tokens)
        if lease.number <= w.counted_upto:
            w.freed_since_report += own
        if w.asking:
            w.freed_since_ask += own


@dataclass(frozen=True)
class Lease:
    """A request sent to a worker: the worker, the request's dispatch number there (its
    `requests` count), and the prompt tokens it likely found cached."""
    worker: WorkerState
    number: int
    matched_tokens: int = 0
    exact: bool = False  # matched_tokens from the worker's KV events (else the approximate index)


def is_down(error: BaseException) -> bool:
    """Whether a failed call says the worker is unreachable or broken (not a bad request)."""
    if isinstance(error, WorkerError):
        return error.down
    return isinstance(error, ConnectionError | OSError) and not isinstance(error, TimeoutError)


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _join(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _describe(error: BaseException) -> str:
    if isinstance(error, WorkerError):
        return error.message
    return f"{type(error).__name__}: {error}"

