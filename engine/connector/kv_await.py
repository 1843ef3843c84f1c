"""Loads of an early hand-off: KV a producer is still saving (a decode dispatched beside its
prefill, engine/connector/kvstore_worker.py).

One thread serves every such load. Each round first asks the store, per chunk of each load,
for its lowest layer not received yet (a probe: a few keys, however many are missing), then
for every other missing layer of each chunk whose probe came, and writes what came into the
requests' blocks. Between rounds it waits `await_poll_s` after a round that brought
something, twice as long after each that brought nothing (up to MAX_BACKOFF times: a prefill
queued behind others is seldom polled), and not at all after `hurry` (the prefill's first
token came: every object is saved, or never will be) or when a load is added or cancelled.

A load waits as long as its request does until `hurry`; from then it has `await_s` (a grace
for saves still under way; none while the store fails) before what is missing counts as
missing (those tokens are recomputed). `cancel` (the request was aborted) ends it with
nothing valid. A store that fails a round is asked again in the next (the failure is logged
once per streak). Each load's future gives (tokens valid from the start, first error or
None), as the connector's other loads do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.connector.kvstore_meta import LoadSpec

logger = logging.getLogger(__name__)
MAX_BACKOFF = 4


@dataclass
class LoadState:
    valid: int  # tokens from the start still valid (lowered by a bad object)
    error: str | None = None
    nbytes: int = 0  # KV payload received
    abandoned: bool = False  # a layer-wise load the step stopped waiting for


@dataclass
class _Awaiting:
    spec: LoadSpec
    todo: list[tuple[int, int]]  # (layer, chunk) not received yet
    state: LoadState
    deadline: float | None = None  # monotonic; set by hurry
    started: float = field(default_factory=time.perf_counter)
    future: Future[tuple[int, str | None]] = field(default_factory=Future)
    cancelled: bool = False


Apply = Callable[[LoadSpec, int, int, Any, LoadState], None]


class AwaitingLoads:
    def __init__(self, client: Any, apply: Apply,
                 record: Callable[[LoadSpec, LoadState, float], None],
                 store_failed: Callable[[], None]) -> None:
        self._client = client
        self._apply = apply  # writes one object (None: missing) into the request's blocks
        self._record = record
        self._store_failed = store_failed
        self._loads: dict[str, _Awaiting] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._wake = False  # a load was added, cancelled or hurried: the next round at once
        self._thread: threading.Thread | None = None
        self._backoff = 1  # the next wait, in await_poll_s
        self._failing = False  # the last round's store call failed

    def add(self, spec: LoadSpec, chunks: Callable[[LoadSpec, int], list[int]], num_layers: int
            ) -> Future[tuple[int, str | None]]:
        todo = [(layer, c) for layer in range(num_layers) for c in chunks(spec, layer)]
        load = _Awaiting(spec, todo, LoadState(spec.end))
        with self._cond:
            self._loads[spec.req_id] = load
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-await-loader", daemon=True)
                self._thread.start()
            self._wake = True
            self._cond.notify_all()
        return load.future

    def cancel(self, req_id: str) -> None:
        """The request was aborted: its load ends at the next round, with nothing valid."""
        with self._cond:
            load = self._loads.get(req_id)
            if load is not None:
                load.cancelled = True
                self._wake = True
                self._cond.notify_all()

    def hurry(self, req_id: str) -> None:
        """The request's producer is done: ask for its missing objects now; what has not come
        within await_s counts as missing."""
        with self._cond:
            load = self._loads.get(req_id)
            if load is not None:
                # a store failing now is not waited for (the plain load would not wait either)
                load.deadline = time.monotonic() + (0.0 if self._failing else load.spec.await_s)
                self._wake = True
                self._backoff = 1
                self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._loads and not self._closing:
                    self._cond.wait()
                if self._closing:
                    self._end_all("the connector shut down")
                    return
                loads = list(self._loads.values())
                self._wake = False
            try:
                progressed = self._round(loads)
            except Exception as exc:  # a bug here must not leave requests waiting forever
                logger.exception("awaiting KV loads failed")
                with self._cond:
                    self._end_all(f"the KV loader failed: {exc!r}")
                continue
            with self._cond:
                for load in loads:
                    if load.future.done():
                        self._loads.pop(load.spec.req_id, None)
                waiting = [load for load in self._loads.values() if not load.cancelled]
                poll = min((load.spec.await_poll_s for load in waiting), default=0.0)
                if waiting and not self._wake:
                    self._backoff = 1 if progressed else min(2 * self._backoff, MAX_BACKOFF)
                    self._cond.wait_for(lambda: self._wake or self._closing, poll * self._backoff)

    def _end_all(self, why: str) -> None:
        for load in self._loads.values():
            self._end(load, why, valid=load.spec.start)
        self._loads.clear()

    def _round(self, loads: list[_Awaiting]) -> bool:
        """One look at the store (module docstring); ends the loads that are complete, past
        their deadline or cancelled. True when some object came."""
        live = [load for load in loads if not load.cancelled]
        probes = []
        for load in live:
            seen: set[int] = set()
            for layer, c in load.todo:  # layer-major: the first of each chunk is its lowest
                if c not in seen:
                    seen.add(c)
                    probes.append((load, layer, c))
        got: set[tuple[int, int, int]] = set()
        try:
            got = self._fetch(probes)
            hit = {(id(load), c) for load, layer, c in probes if (id(load), layer, c) in got}
            rest = [(load, layer, c) for load in live for layer, c in load.todo
                    if (id(load), c) in hit and (id(load), layer, c) not in got]
            got |= self._fetch(rest)
            self._failing = False
        except Exception as exc:  # the store failed: asked again next round (what came stays)
            self._store_failed()
            if not self._failing:
                logger.warning("KV store failed while %d early loads wait (asking again): %s",
                               len(live), exc)
            self._failing = True
        for load in live:
            load.todo = [(layer, c) for layer, c in load.todo if (id(load), layer, c) not in got]
        now = time.monotonic()
        for load in loads:
            if load.cancelled:
                self._end(load, "the request was aborted", valid=load.spec.start)
                continue
            if load.todo and load.deadline is not None and now >= load.deadline:
                for layer, c in load.todo:  # never saved: missing (its tokens are recomputed)
                    self._apply(load.spec, layer, c, None, load.state)
                logger.warning("KV of %s: %d objects not in the store %.1f s after its first token; "
                               "their tokens are recomputed", load.spec.req_id, len(load.todo),
                               load.spec.await_s)
                load.todo = []
            if not load.todo:
                self._end(load, load.state.error)
        return bool(got)

    def _fetch(self, wanted: list[tuple[_Awaiting, int, int]]) -> set[tuple[int, int, int]]:
        """Asks for these (load, layer, chunk) objects in one call; writes those that came
        into their blocks and returns them as (id(load), layer, chunk)."""
        if not wanted:
            return set()
        keys = [f"{load.spec.chunk_keys[c]}@{layer}" for load, layer, c in wanted]
        got = set()
        for i, obj in self._client.get_stream(keys, batch=len(keys)):
            if obj is not None:
                load, layer, c = wanted[i]
                self._apply(load.spec, layer, c, obj, load.state)
                got.add((id(load), layer, c))
        return got

    def _end(self, load: _Awaiting, error: str | None, valid: int | None = None) -> None:
        if load.future.done():
            return
        if valid is not None:
            load.state.valid = valid
        load.state.error = load.state.error or error
        self._record(load.spec, load.state, time.perf_counter() - load.started)
        load.future.set_result((max(load.state.valid, load.spec.start), load.state.error))
