"""Layer-wise KV loads: inside the step that computes their requests, the forward waits for each
layer it needs while a background loader fetches the layers in order.

One step's loads at a time (`start` with the step's specs, `collect` after its forward). The
loader streams every spec's chunks layer-major from the store and writes each object through the
worker's `apply`; layer l's event is set when its last key arrived (or the load failed). The
forward's `wait(layer)` waits for that event at most `load_wait_s` since the last layer that
arrived (a slow store that delivers goes on); past it every load of the step is abandoned: they
count as failed (their requests recompute), nothing the loader still gets is written (their
blocks may be reused), and no later layer waits. A store that failed a call within the
worker's breaker window is not waited on at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.connector.base import KVConnectorOutput
from engine.connector.kv_await import LoadState
from engine.connector.kvstore_meta import LoadSpec

logger = logging.getLogger(__name__)

Apply = Callable[[LoadSpec, int, int, Any, LoadState], None]  # spec, layer, chunk, object, state


class LayerwiseLoads:
    def __init__(self, client: Any, apply: Apply, chunks: Callable[[LoadSpec, int], list[int]],
                 record: Callable[[LoadSpec, LoadState, float], None],
                 store_down: Callable[[], bool], store_failed: Callable[[], None],
                 load_wait_s: float | None, breaker_s: float) -> None:
        self._client = client
        self._apply = apply
        self._chunks = chunks
        self._record = record
        self._store_down = store_down
        self._store_failed = store_failed
        # The longest a step's forward waits for its layer-wise loads in all (None: no bound);
        # past it they count as failed (their requests recompute) and the forward goes on.
        self.load_wait_s = load_wait_s
        self.breaker_s = breaker_s
        self._progress = 0.0  # when this step's last layer arrived (or its loads started)
        self._layers_done = 0
        self._apply_lock = threading.Lock()
        self._events: list[threading.Event] = []
        self._loads: list[tuple[LoadSpec, LoadState]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-layer-loader")

    @property
    def active(self) -> bool:
        return bool(self._events)

    def start(self, specs: list[LoadSpec], num_layers: int) -> None:
        events = [threading.Event() for _ in range(num_layers)]
        states = {spec.req_id: LoadState(spec.end) for spec in specs}
        self._events = events
        self._loads = [(spec, states[spec.req_id]) for spec in specs]
        self._progress, self._layers_done = time.monotonic(), 0
        if self.load_wait_s is not None and self._store_down():
            self._abandon(f"the KV store failed within {self.breaker_s:g} s")  # no wait again
            return
        # Layer-major, every spec's chunks per layer: layer l is complete at its last key (a
        # layer with none, nothing to load, completes with the one before it).
        plan = [(layer, spec, c) for layer in range(num_layers) for spec in specs
                for c in self._chunks(spec, layer)]
        self._pool.submit(self._run, plan, specs, states, events)

    def _run(self, plan: list[tuple[int, LoadSpec, int]], specs: list[LoadSpec],
             states: dict[str, LoadState], events: list[threading.Event]) -> None:
        start = time.perf_counter()
        last = {layer: i for i, (layer, _, _) in enumerate(plan)}
        per_layer = max(Counter(layer for layer, _, _ in plan).values(), default=1)
        done = 0  # layers whose event is set
        try:
            stream = self._client.get_stream(
                [f"{spec.chunk_keys[c]}@{layer}" for layer, spec, c in plan], batch=per_layer)
            for i, obj in stream:
                layer, spec, c = plan[i]
                state = states[spec.req_id]
                with self._apply_lock:  # an abandoned load writes nothing (its blocks may be reused)
                    if state.abandoned:
                        break
                    if state.valid > spec.start:
                        self._apply(spec, layer, c, obj, state)
                if last.get(layer) == i:
                    self._progress, self._layers_done = time.monotonic(), layer + 1
                    for event in events[done:layer + 1]:
                        event.set()
                    done = layer + 1
        except Exception as exc:  # store unreachable: nothing of it counts
            self._store_failed()
            for spec in specs:
                state = states[spec.req_id]
                state.valid = spec.start
                state.error = state.error or f"loading from the KV store failed: {exc}"
        finally:
            for event in events[done:]:
                event.set()
            for spec in specs:
                self._record(spec, states[spec.req_id], time.perf_counter() - start)

    def wait(self, layer: int) -> None:
        """Waits for layer `layer` of this step's loads, until load_wait_s passes without a new
        layer: then they all fail and no later layer waits."""
        if not self._events:
            return
        event = self._events[layer]
        while self.load_wait_s is not None and not event.is_set():
            # the bound runs from the last layer that arrived: a slow store that delivers goes on
            if event.wait(max(0.0, self._progress + self.load_wait_s - time.monotonic())):
                break
            if time.monotonic() - self._progress >= self.load_wait_s:
                self._abandon(f"the KV store delivered no layer for {self.load_wait_s:g} s",
                              store_failed=self._layers_done == 0)
                break
        event.wait()  # set: delivered, failed, or abandoned

    def _abandon(self, why: str, store_failed: bool = True) -> None:
        """This step's loads failed; once this returns, nothing the loader still gets is written
        (the scheduler frees those requests' blocks). `store_failed`: the store delivered
        nothing, and is not waited on for breaker_s."""
        logger.warning("%s: %d layer-wise load(s) fail, their requests recompute", why, len(self._loads))
        if store_failed:
            self._store_failed()
        with self._apply_lock:  # no write in progress or to come
            for spec, state in self._loads:
                state.abandoned = True
                state.valid = spec.start
                state.error = state.error or why
        for event in self._events:
            event.set()

    def collect(self, out: KVConnectorOutput) -> None:
        """After the step's forward (or a step without one): every layer waited for, each load's
        outcome into `out`, and the step's loads forgotten."""
        if not self._events:
            return
        self.wait(len(self._events) - 1)
        for spec, state in self._loads:
            out.finished_recving.add(spec.req_id)
            if state.valid < spec.end or state.error is not None:
                out.valid_loaded_tokens[spec.req_id] = max(state.valid, spec.start)
                out.load_errors[spec.req_id] = state.error or "incomplete load"
        self._events, self._loads = [], []

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
