"""Worker half of the KV store connector: moves KV between the paged cache and the store.

Saves: after each layer's forward, the new prompt chunks of that layer are copied out of the
paged cache (one small gather) and queued for a background sender, so sending overlaps the
next layers' compute; `wait_for_save` at the end of the step waits for that step's objects
(at most `save_wait_s`: a slow or frozen store does not hold the step; what is still unsent then
goes on in the background, and a consumer that does not find it recomputes).
Objects are LMCache KV_T2D tensors `[tokens, 2, kv_heads * head_dim]` under
`LayerCacheEngineKey` strings with `RemoteMetadata` headers.
Loads: a background loader fetches a request's chunks layer by layer and writes them into the
request's blocks, either while other requests keep running (async: the request waits in
WAITING_FOR_REMOTE_KVS) or inside the step that computes the request, whose forward waits for
each layer in turn (layer-wise, engine/connector/kv_layerwise.py); the scheduler half picks per
load (EngineConfig.kv_load_mode).
An early hand-off's load (LoadSpec.await_s, a decode dispatched beside its prefill) runs while
the producer is still saving: it takes each object as it appears (engine/connector/kv_await.py),
until all are in, await_s has passed since the first token came, or the request is aborted.
A missing, short or mismatched object truncates what counts as loaded to the tokens before it,
which the scheduler then recomputes (or fails, by policy).
Integrity (kvstore/integrity.py): the sender puts every object with its checksum (keyed BLAKE3
with the integrity key from PDSERVE_KV_INTEGRITY_KEY, plain BLAKE3 without one); a loaded
object whose checksum does not verify, or that has none while a key is configured, counts as
missing (its tokens are recomputed and never cached from it), `integrity_failures` in the
transfer stats, and a warning naming its key.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.connector.base import KVConnectorOutput, KVConnectorWorker
from engine.connector.kv_await import AwaitingLoads, LoadState
from engine.connector.kv_copy import WorkerTimings, gather_tokens, scatter_tokens
from engine.connector.kv_layerwise import LayerwiseLoads
from engine.connector.kvstore_meta import KVStoreConnectorMetadata, LoadSpec
from engine.core.outputs import KVTransferStats
from kvstore import integrity

logger = logging.getLogger(__name__)


_Item = tuple[str, bytes, Any, bytes]  # key, metadata, payload, token digest (a KV object to put)


def _digest(digests: list[bytes], chunk: int) -> bytes:
    return digests[chunk] if chunk < len(digests) else b""


class KVStoreConnectorWorker(KVConnectorWorker):
    def __init__(self, make_client: Callable[[], Any], chunk_size: int,
                 stream_layers: bool = True, save_wait_s: float | None = None,
                 integrity_key: bytes | None = None, load_wait_s: float | None = None,
                 breaker_s: float = 10.0) -> None:
        self.chunk_size = chunk_size
        # A store that failed a call (or a step's wait) is not waited on for this long after:
        # saves go on behind the step, layer-wise loads fail at once (as the client's breaker).
        self.breaker_s = breaker_s
        self._store_failed_at = -1e9  # the last send or load the store failed (monotonic)
        # kvstore.integrity.load_key() (the factory passes it); None: plain BLAKE3 checksums
        self.integrity_key = integrity_key
        self.integrity_checks = True  # False: no checksums put, none verified (benchmarks only)
        self.save_wait_s = save_wait_s  # None: wait for every save
        # False: hold a step's objects and send them all after the last layer (whole-request
        # transfer, for comparison); True: send each layer while the next ones compute.
        self.stream_layers = stream_layers
        self._held: list[_Item] = []
        self.timings = WorkerTimings()
        self._stats = KVTransferStats()
        self._stats_lock = threading.Lock()  # loader, layer loader and sender threads update it
        self._send_client = make_client()
        self._load_client = make_client()
        self.kv_caches: list[torch.Tensor] = []
        self.layer_group: list[int] = []  # per layer, its KV cache group
        self._meta = KVStoreConnectorMetadata()
        self._queue: queue.Queue[list[_Item] | None] = queue.Queue(maxsize=64)
        self._unsent = 0
        self._sent = threading.Condition()
        self.send_errors = 0
        self._sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._sender.start()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-loader")
        self._loads: dict[str, tuple[LoadSpec, Future[tuple[int, str | None]]]] = {}
        self._awaiter = AwaitingLoads(make_client(), self._apply, self._record_load, self._store_failed)
        self._wakeup: Callable[[], None] = _nothing
        self._layerwise = LayerwiseLoads(make_client(), self._apply, self._chunks, self._record_load,
                                         self._store_down, self._store_failed, load_wait_s, breaker_s)

    def register_kv_caches(self, kv_caches: list[Any], layer_group: list[int] | None = None) -> None:
        self.kv_caches = list(kv_caches)
        self.layer_group = list(layer_group) if layer_group is not None else [0] * len(kv_caches)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata if metadata is not None else KVStoreConnectorMetadata()

    def clear_connector_metadata(self) -> None:
        self._meta = KVStoreConnectorMetadata()

    # --- saves ----------------------------------------------------------------------------
    def save_kv_layer(self, layer: int, kv_cache: Any) -> None:
        if not self._meta.saves:
            return
        from kvstore.lmcache_format import MemoryFormat, RemoteMetadata

        items = []
        for spec in self._meta.saves:
            for chunk, start, end in spec.chunks:
                data = gather_tokens(kv_cache, spec.block_ids[self.layer_group[layer]], start, end)
                meta = RemoteMetadata.single(tuple(data.shape), data.dtype, MemoryFormat.KV_T2D).pack()
                items.append((f"{spec.chunk_keys[chunk]}@{layer}", meta, data.view(torch.uint8).numpy(),
                              _digest(spec.token_digests, chunk)))
        if not self.stream_layers:
            self._held.extend(items)
            return
        self._enqueue(items)

    def _enqueue(self, items: list[_Item]) -> None:
        """Queues a layer's objects for the sender; with the queue full (a store that does not
        keep up, or frozen) they are dropped, never waited for: a consumer that misses them
        recomputes."""
        with self._sent:
            self._unsent += 1
        try:
            self._queue.put_nowait(items)
        except queue.Full:
            with self._sent:
                self._unsent -= 1
            self.send_errors += 1
            self._record_save(items, 0.0, failed=True)

    def _send_loop(self) -> None:
        while True:
            items = self._queue.get()
            if items is None:
                return
            start = time.perf_counter()
            failed = False
            try:
                # Hashed here, off the forward's thread (blake3 lets go of the GIL).
                key = self.integrity_key
                self._send_client.put([(k, meta, data, integrity.checksum(k, meta, data, key, tokens))
                                       for k, meta, data, tokens in items] if self.integrity_checks
                                      else [(k, meta, data) for k, meta, data, _ in items])
            except Exception as exc:
                failed = True
                self.send_errors += 1
                self._store_failed_at = time.monotonic()
                logger.warning("saving %d KV objects failed: %s", len(items), exc)
            self._record_save(items, time.perf_counter() - start, failed)
            with self._sent:
                self._unsent -= 1
                self._sent.notify_all()

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        if self._held:
            held, self._held = self._held, []
            self._enqueue(held)
        down = self._store_down()
        with self._sent:
            busy = self._unsent > 0
            done = self._sent.wait_for(lambda: self._unsent == 0, timeout=0 if down else self.save_wait_s)
        if not done and not down:  # a slow or frozen store: the step goes on, the sends too, and
            # the next steps do not wait for it while its sends are still stuck
            self._store_failed_at = time.monotonic()
            logger.warning("KV saves still under way after %.1f s; the step goes on", self.save_wait_s)
        if busy:
            self.timings.save_waits.append(time.perf_counter() - start)

    # --- loads ----------------------------------------------------------------------------
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def _loaded(self, future: Future[Any]) -> None:
        self._wakeup()

    def start_load_kv(self) -> None:
        layerwise = [spec for spec in self._meta.loads if spec.layerwise]
        for spec in self._meta.loads:
            if spec.await_s > 0:
                future = self._awaiter.add(spec, self._chunks, len(self.kv_caches))
            elif not spec.layerwise:
                future = self._loader.submit(self._load, spec)
            else:
                continue
            self._loads[spec.req_id] = (spec, future)
            future.add_done_callback(self._loaded)
        for req_id in self._meta.cancels:  # after the adds: they may name a load of this step
            self._awaiter.cancel(req_id)
        for req_id in self._meta.hurries:
            self._awaiter.hurry(req_id)
        if layerwise:
            self._layerwise.start(layerwise, len(self.kv_caches))

    def wait_for_layer_load(self, layer: int) -> None:
        """Async loads run ahead of scheduling (the request waits in WAITING_FOR_REMOTE_KVS);
        layer-wise loads of this step make the forward wait here for layer `layer` only
        (engine/connector/kv_layerwise.py bounds the wait)."""
        self._layerwise.wait(layer)

    def _load(self, spec: LoadSpec) -> tuple[int, str | None]:
        """Loads every layer (one store call for all objects where the store shares memory
        with this process); returns (tokens valid from the start, first error or None)."""
        start = time.perf_counter()
        state = LoadState(spec.end)
        plan = [(layer, c) for layer in range(len(self.kv_caches)) for c in self._chunks(spec, layer)]
        keys = [f"{spec.chunk_keys[c]}@{layer}" for layer, c in plan]
        try:
            # over Flight, a layer's objects in one call (the most chunks any layer loads)
            batch = max(Counter(layer for layer, _ in plan).values(), default=1)
            for i, obj in self._load_client.get_stream(keys, batch=batch):
                layer, c = plan[i]
                self._apply(spec, layer, c, obj, state)
        except Exception as exc:  # store unreachable etc.: nothing loaded
            self._store_failed_at = time.monotonic()
            state.valid, state.error = spec.start, f"loading from the KV store failed: {exc}"
        finally:
            self._record_load(spec, state, time.perf_counter() - start)
        return max(state.valid, spec.start), state.error

    def _group_start(self, spec: LoadSpec, layer: int) -> int:
        """Where the layer's load starts: its KV cache group's start (a windowed group of a
        hybrid model loads only its window)."""
        return spec.group_starts[self.layer_group[layer]] if spec.group_starts else spec.start

    def _chunks(self, spec: LoadSpec, layer: int) -> list[int]:
        cs = self.chunk_size
        return list(range(self._group_start(spec, layer) // cs, (spec.end - 1) // cs + 1))

    def _apply(self, spec: LoadSpec, layer: int, c: int, obj: Any, state: LoadState) -> None:
        """Writes chunk `c` of `layer` from its object; a missing or mismatched object lowers
        `state.valid` to the tokens before it."""
        from kvstore.lmcache_format import RemoteMetadata, buffer_to_tensor

        cs = self.chunk_size
        kv = self.kv_caches[layer]
        width = kv.shape[3] * kv.shape[4]
        if obj is not None:
            state.nbytes += len(obj.data)
        lo, hi = max(self._group_start(spec, layer), c * cs), min(spec.end, (c + 1) * cs)
        if hi <= lo or lo >= state.valid:
            return
        problem = None
        if obj is None:
            problem = "missing"
        else:
            try:
                meta = RemoteMetadata.unpack(obj.metadata)
                shape = meta.shapes[0]
                n = shape[0]
                if (meta.length != len(obj.data) or tuple(shape[1:]) != (2, width)
                        or meta.dtypes[0] != str(kv.dtype).removeprefix("torch.")
                        or c * cs + n < hi):
                    problem = f"does not match ({meta.length} bytes, shape {shape})"
            except ValueError as exc:
                problem = f"has bad metadata: {exc}"
        if problem is None:
            assert obj is not None
            problem = self._check_integrity(f"{spec.chunk_keys[c]}@{layer}", obj,
                                            _digest(spec.token_digests, c))
        if problem is not None:
            state.valid = min(state.valid, lo)
            state.error = state.error or f"KV object of chunk {c} layer {layer} {problem}"
            return
        assert obj is not None
        data = buffer_to_tensor(obj.data, kv.dtype, (n, 2, width))
        scatter_tokens(kv, spec.block_ids[self.layer_group[layer]], lo, data[lo - c * cs: hi - c * cs])

    def _check_integrity(self, key: str, obj: Any, tokens: bytes) -> str | None:
        """None when the object's checksum verifies for these tokens; else why not (counted and
        logged)."""
        if not self.integrity_checks or integrity.verify(key, obj.metadata, obj.data, obj.checksum,
                                                         self.integrity_key, tokens):
            return None
        why = "has a checksum that does not match" if obj.checksum else "has no checksum"
        logger.warning("KV object %s %s (integrity key %s): treated as missing, its tokens are "
                       "recomputed", key, why, "set" if self.integrity_key else "not set")
        with self._stats_lock:
            self._stats.integrity_failures += 1
        return f"failed its integrity check ({why})"

    def _store_failed(self) -> None:
        self._store_failed_at = time.monotonic()

    def _store_down(self) -> bool:
        """Whether the store failed a call (or a step's wait) within breaker_s."""
        return time.monotonic() - self._store_failed_at < self.breaker_s

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        self._layerwise.collect(out)  # a step without a forward too
        for req_id, (spec, fut) in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[req_id]
            valid, error = fut.result()
            out.finished_recving.add(req_id)
            if valid < spec.end or error is not None:
                out.valid_loaded_tokens[req_id] = valid
                out.load_errors[req_id] = error or "incomplete load"
        return out

    # --- stats ----------------------------------------------------------------------------
    def _record_load(self, spec: LoadSpec, state: LoadState, seconds: float) -> None:
        self.timings.record_load(spec.req_id, seconds)
        failed = state.error is not None or state.valid < spec.end
        with self._stats_lock:
            self._stats.load_seconds.observe(seconds)
            self._stats.load_bytes += state.nbytes
            self._stats.load_failures += failed

    def _record_save(self, items: list[_Item], seconds: float, failed: bool) -> None:
        nbytes = sum(len(meta) + memoryview(data).nbytes for _, meta, data, _ in items)  # no checksums
        with self._stats_lock:
            self._stats.save_seconds.observe(seconds)
            if failed:
                self._stats.save_failures += 1
            else:
                self._stats.save_bytes += nbytes

    def get_transfer_stats(self) -> KVTransferStats:
        with self._stats_lock:
            return self._stats.copy()

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._sender.join(timeout=10)
        self._loader.shutdown(wait=True)
        self._layerwise.shutdown()
        self._awaiter.shutdown()


def _nothing() -> None:
    pass
