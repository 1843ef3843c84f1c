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
Tensor parallelism (engine/parallel/, kv_shards.py): on the CPU every rank's KV cache is in shared
memory, and rank 0's connector moves all of them: each rank's head shard is saved under that
rank's key (world size and worker id), and a load reads the objects of the producer's ranks
(its TP size from the load's keys), joins their heads and writes each rank's share into that
rank's cache, whatever the two TP sizes.
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
from engine.connector.kv_copy import WorkerTimings, check_object, gather_tokens, scatter_tokens
from engine.connector.kv_layerwise import LayerwiseLoads
from engine.connector.kv_shards import (
    HeadSplit,
    ShardLayout,
    ShardParts,
    ShardReader,
    assemble,
    rank_key,
    shard_of,
)
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
                 breaker_s: float = 10.0, world: int = 1) -> None:
        self.chunk_size = chunk_size
        self.shards = ShardLayout(world)
        self.rank_caches: list[list[torch.Tensor]] = []  # per rank, per layer (rank 0's first)
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
        # per request, for traces: KV bytes queued this step (and when the step began saving),
        # (bytes, seconds) of the steps whose saves ended, and of the loads that ended
        self._step_saves: dict[str, int] = {}
        self._save_started: float | None = None
        self._saved: dict[str, tuple[int, float]] = {}
        self._req_loads: dict[str, tuple[int, float]] = {}
        self.timings = WorkerTimings()
        self._stats = KVTransferStats()
        self._stats_lock = threading.Lock()  # loader, layer loader and sender threads update it
        self._send_client = make_client()
        self._load_client = ShardReader(make_client(), self.shards)
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
        self._awaiter = AwaitingLoads(ShardReader(make_client(), self.shards), self._apply,
                                      self._record_load, self._store_failed)
        self._wakeup: Callable[[], None] = _nothing
        self._layerwise = LayerwiseLoads(ShardReader(make_client(), self.shards), self._apply, self._chunks,
                                         self._record_load, self._store_down, self._store_failed,
                                         load_wait_s, breaker_s)

    def register_kv_caches(self, kv_caches: list[Any], layer_group: list[int] | None = None) -> None:
        self.kv_caches = list(kv_caches)
        self.layer_group = list(layer_group) if layer_group is not None else [0] * len(kv_caches)
        if not self.rank_caches:
            self.register_rank_caches([self.kv_caches], int(self.kv_caches[0].shape[3]))

    def register_rank_caches(self, rank_caches: list[list[torch.Tensor]], kv_heads: int) -> None:
        """Tensor parallelism: every rank's caches (shared memory), and the model's KV heads."""
        if len(rank_caches) != self.shards.world:
            raise ValueError(f"{len(rank_caches)} ranks' caches for a world of {self.shards.world}")
        self.rank_caches = rank_caches
        self.shards.kv_heads, self.shards.head_dim = kv_heads, int(rank_caches[0][0].shape[4])

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
        world = self.shards.world
        if self._save_started is None:
            self._save_started = time.perf_counter()
        for spec in self._meta.saves:
            blocks = spec.block_ids[self.layer_group[layer]]
            saved = self._step_saves.get(spec.req_id, 0)
            for chunk, start, end in spec.chunks:
                chunk_key = spec.chunk_keys[chunk]
                for rank, caches in enumerate(self.rank_caches):  # each rank's head shard
                    data = gather_tokens(caches[layer], blocks, start, end)
                    meta = RemoteMetadata.single(tuple(data.shape), data.dtype, MemoryFormat.KV_T2D).pack()
                    key = rank_key(chunk_key, world, rank) if world > 1 else chunk_key
                    items.append((f"{key}@{layer}", meta, data.view(torch.uint8).numpy(),
                                  _digest(spec.token_digests, chunk)))
                    saved += data.numel() * data.element_size()
            self._step_saves[spec.req_id] = saved
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
        if self._save_started is not None:  # the step's saves, first layer queued -> all sent
            seconds = time.perf_counter() - self._save_started
            for req_id, nbytes in self._step_saves.items():
                self._saved[req_id] = (nbytes, seconds)
            self._step_saves.clear()
            self._save_started = None

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
        """Writes chunk `c` of `layer` from its object (or, under tensor parallelism, from its
        source ranks' objects, a ShardParts) into every rank's cache; a missing or mismatched
        object lowers `state.valid` to the tokens before it."""
        from kvstore.lmcache_format import buffer_to_tensor

        cs = self.chunk_size
        if isinstance(obj, ShardParts):
            parts, source = list(zip(obj.ranks, obj.keys, obj.objects, strict=True)), obj.world
        else:
            parts, source = ([] if obj is None else [(0, f"{spec.chunk_keys[c]}@{layer}", obj)]), 1
        for _, _, o in parts:
            state.nbytes += len(o.data)
        lo, hi = max(self._group_start(spec, layer), c * cs), min(spec.end, (c + 1) * cs)
        if hi <= lo or lo >= state.valid:
            return
        kv = self.rank_caches[0][layer]
        split = HeadSplit(self.shards.kv_heads, source)
        problem, n = ("missing", 0) if not parts else (None, 0)
        for rank, key, o in parts:
            width = split.of(rank)[1] * self.shards.head_dim
            problem, n = check_object(o, width, str(kv.dtype).removeprefix("torch."), c * cs, hi)
            problem = problem or self._check_integrity(key, o, _digest(spec.token_digests, c))
            if problem is not None:
                break
        if problem is not None:
            state.valid = min(state.valid, lo)
            state.error = state.error or f"KV object of chunk {c} layer {layer} {problem}"
            return
        full = assemble([buffer_to_tensor(o.data, kv.dtype, (n, 2, split.of(r)[1] * self.shards.head_dim))
                         for r, _, o in parts], split, self.shards.head_dim)
        mine = HeadSplit(self.shards.kv_heads, self.shards.world)
        blocks = spec.block_ids[self.layer_group[layer]]
        for rank, caches in enumerate(self.rank_caches):
            piece = shard_of(full, mine, rank, self.shards.head_dim)
            scatter_tokens(caches[layer], blocks, lo, piece[lo - c * cs: hi - c * cs])

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
        out.save_stats, self._saved = self._saved, {}
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
        with self._stats_lock:  # last: every load found done above has been recorded
            out.load_stats, self._req_loads = self._req_loads, {}
        return out

    # --- stats ----------------------------------------------------------------------------
    def _record_load(self, spec: LoadSpec, state: LoadState, seconds: float) -> None:
        self.timings.record_load(spec.req_id, seconds)
        failed = state.error is not None or state.valid < spec.end
        with self._stats_lock:
            self._req_loads[spec.req_id] = (state.nbytes, seconds)
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

