"""Scheduler half of the KV store connector (no tensors).

Keys: a prompt is cut into chunks of `kv_chunk_size` tokens, each keyed by LMCache's chunk hash
chain (`CacheEngineKey` strings; the worker appends the layer) and bound to its tokens by a token
digest (engine/connector/keys.py), so any engine of the same model finds prefixes that any other
engine saved (cross-instance reuse) and never takes KV computed for other tokens. Producers (and
`kv_both`) save every prompt chunk once it is computed; a finished `do_remote_decode` request
returns `kv_transfer_params` (keys, token count, transfer id) and leases its objects in the store
so they survive until the consumer acknowledges (releases) them or the lease expires. Consumers
load what `do_remote_prefill` names, under the keys of their own tokens (the worker's edge refuses
a call whose keys disagree), or the longest prefix found in the store.

The store is never waited on inside a step for longer than `lookup_wait_s`, once per request:
lookups run in a background thread (a request whose lookup has not answered waits in the queue,
"ask again later", while everything else runs; one that fails or times out computes locally), and
releases are sent from it without waiting (a lost one: the lease expires on its own). A lease is
sent from it too and waited for at most `lease_wait_s` (~1 ms from a live store; the control
client's breaker makes a dead store's fail at once after its first timeout), so it normally lands
before the consumer can release it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.connector.base import KVConnectorOutput, KVConnectorScheduler
from engine.connector.keys import KeyScheme
from engine.connector.kv_shards import every_rank, rank_key, world_of
from engine.connector.kvstore_meta import KVStoreConnectorMetadata, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from engine.core.outputs import SchedulerOutput
    from engine.core.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConnectorOptions:
    role: str  # kv_producer, kv_consumer or kv_both
    num_layers: int
    lease_s: float  # how long a producer's objects are kept for their consumer
    store_url: str  # what kv_transfer_params tell the consumer
    load_mode: str = "async"  # "async", "layerwise" or "auto" (EngineConfig.kv_load_mode)
    layerwise_max_tokens: int = 0  # "auto": layer-wise up to this many tokens
    lookup_wait_s: float = 0.05  # the longest a step waits for a lookup before asking again later
    lease_wait_s: float = 1.0  # the longest a step waits for a lease (the control calls' timeout)
    block_size: int = 16  # the engine's (a load skips the null blocks a sliding window leaves)
    await_s: float = 1.0  # an early hand-off's load: how long after the first token missing objects may come
    await_poll_s: float = 0.05  # ... asking again for the missing ones this often


@dataclass
class _Tracked:
    """One request, from when the connector first sees it until `request_finished`."""

    prompt_ids: list[int]
    salt: str | None
    transfer: dict[str, Any]  # its kv_transfer_params ({} without)
    keys: list[str] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_chunks: int = 0  # chunks saved (or known to be in the store) from the start
    lookup: Future[int] | None = None  # the store's prefix of it, in chunks (asked once)
    pending_load: LoadSpec | None = None  # matched, waiting for its blocks
    loading: LoadSpec | None = None  # handed to the worker half
    released: bool = False  # the transfer was acknowledged to its producer
    loaded: bool = False  # a load of it finished
    no_save_this_step: bool = False  # a layer-wise load: this step's KV rests on it


class KVStoreConnectorScheduler(KVConnectorScheduler):
    def __init__(self, client: Any, scheme: KeyScheme, options: StoreConnectorOptions,
                 calls: ThreadPoolExecutor | None = None) -> None:
        self.client = client
        self.scheme = scheme
        self.options = options
        self.chunk_size = scheme.chunk_size
        # One thread: the store's answers keep their order; the step never waits on it long.
        self._calls = calls or ThreadPoolExecutor(1, thread_name_prefix="kv-control")
        self._tracked: dict[str, _Tracked] = {}
        self._loads_to_start: list[LoadSpec] = []
        self._cancels: list[str] = []
        self._hurries: list[str] = []

    @property
    def saves(self) -> bool:
        return self.options.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.options.role in ("kv_consumer", "kv_both")

    def _track(self, req_id: str, prompt_ids: list[int], salt: str | None,
               transfer: dict[str, Any] | None) -> _Tracked:
        tracked = self._tracked.get(req_id)
        if tracked is None:
            tracked = self._tracked[req_id] = _Tracked(prompt_ids, salt, dict(transfer or {}))
            tracked.keys = self.scheme.chunk_keys(prompt_ids, salt)
            tracked.digests = self.scheme.token_digests(prompt_ids, salt)
        return tracked

    def _track_request(self, request: Request) -> _Tracked:
        return self._track(request.request_id, list(request.prompt_token_ids), request.cache_salt,
                           request.sampling_params.kv_transfer_params)

    def layer_keys(self, chunk_keys: list[str]) -> list[str]:
        return [f"{k}@{layer}" for k in chunk_keys for layer in range(self.options.num_layers)]

    # --- loads ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._track_request(request)
        if not self.loads:
            return 0, False
        # The last token is always computed here (logits); one that awaits its first token
        # computes that token: every prompt token may load.
        awaiting = request.awaiting_first_token
        limit = request.num_tokens if awaiting else request.num_tokens - 1
        if tracked.transfer.get("do_remote_prefill"):
            # The producer's prompt is the first num_tokens of ours: its keys are ours for them.
            n = min(int(tracked.transfer.get("num_tokens", 0)), len(tracked.prompt_ids))
            # under the producer's tensor-parallel size (its objects are its ranks' head shards)
            source = _source_world(tracked.transfer)
            keys = [rank_key(k, source, 0)
                    for k in self.scheme.chunk_keys(tracked.prompt_ids[:n], tracked.salt)]
            digests = self.scheme.token_digests(tracked.prompt_ids[:n], tracked.salt)
            # the producer names its keys once it is done; before that it saves them all
            available = n if awaiting else min(n, len(tracked.transfer.get("keys", [])) * self.chunk_size)
        elif awaiting:
            return 0, False  # an early hand-off names its producer (the edge checks it)
        else:
            found = self._found(tracked)
            if found is None:
                return None, False  # the store has not answered yet: ask again next step
            keys, digests = tracked.keys, tracked.digests
            available = min(found * self.chunk_size, request.num_prompt_tokens)
        end = min(available, limit)
        if end <= num_computed_tokens:
            return 0, False
        layerwise = not awaiting and self._layerwise(end - num_computed_tokens)
        tracked.pending_load = LoadSpec(request.request_id, keys, num_computed_tokens, end,
                                        token_digests=digests, layerwise=layerwise,
                                        await_s=self.options.await_s if awaiting else 0.0,
                                        await_poll_s=self.options.await_poll_s)
        return end - num_computed_tokens, not layerwise

    def on_first_token(self, request: Request, kv_transfer_params: dict[str, Any] | None) -> None:
        """The producer's keys arrive with the first token: its lease is released once the
        load is done (now, when it is)."""
        tracked = self._track_request(request)
        tracked.transfer.update(kv_transfer_params or {})
        tracked.transfer["do_remote_prefill"] = True
        if tracked.loaded and tracked.loading is None:
            self._release(tracked)
        elif tracked.loading is not None:  # the producer is done: its last objects are in
            self._hurries.append(request.request_id)

    def cancel_load(self, req_id: str) -> None:
        self._cancels.append(req_id)

    def _found(self, tracked: _Tracked) -> int | None:
        """Chunks of the prompt the store holds (one lookup per request, in the background); None
        while it has not answered within lookup_wait_s. A failed lookup means "compute"."""
        if tracked.lookup is None:
            last_layer = [f"{k}@{self.options.num_layers - 1}" for k in tracked.keys]
            tracked.lookup = self._calls.submit(self.client.lookup, last_layer)
            wait([tracked.lookup], timeout=self.options.lookup_wait_s)  # the first ask only
        if not tracked.lookup.done():
            return None
        try:
            return int(tracked.lookup.result())
        except Exception as exc:  # an unreachable store means "compute"
            logger.warning("kv store lookup failed, computing locally: %s", exc)
            return 0

    def _layerwise(self, tokens: int) -> bool:
        """Whether a load of `tokens` tokens goes inside the step that schedules it."""
        if self.options.load_mode == "auto":
            return tokens <= self.options.layerwise_max_tokens
        return self.options.load_mode == "layerwise"

    def update_state_after_alloc(self, request: Request, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        tracked = self._track_request(request)
        spec, tracked.pending_load = tracked.pending_load, None
        if spec is None or num_external_tokens == 0:
            return
        spec.block_ids = [list(ids) for ids in block_ids]
        # A windowed group's leading blocks may be null (never allocated, engine/core): the
        # window of the first token computed here does not reach them, so nothing loads there.
        starts = []
        for ids in block_ids:
            skipped = max((i + 1 for i, b in enumerate(ids) if b == 0), default=0)
            starts.append(min(spec.end, max(spec.start, skipped * self.options.block_size)))
        spec.start = min(starts)
        spec.group_starts = starts
        self._loads_to_start.append(spec)
        tracked.loading = spec
        # what this step computes rests on a layer-wise load: save it only if the load held
        tracked.no_save_this_step = spec.layerwise

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.loading is None:
                continue
            spec, tracked.loading = tracked.loading, None
            tracked.loaded = True
            if req_id in output.load_errors:
                # A failed layer-wise step saved nothing; save again from the valid chunks.
                valid = output.valid_loaded_tokens.get(req_id, spec.start)
                tracked.saved_chunks = 0 if spec.layerwise else valid // self.chunk_size
            else:  # what was loaded is in the store already: do not upload it again
                tracked.saved_chunks = max(tracked.saved_chunks, spec.end // self.chunk_size)
            self._release(tracked)

    def _release(self, tracked: _Tracked) -> None:
        """The consumer's acknowledgement of a transfer: the producer's lease on it ends (sent in
        the background; the lease expires on its own if it is lost)."""
        if not tracked.transfer.get("do_remote_prefill") or tracked.released:
            return
        if not tracked.transfer.get("keys"):  # an early hand-off's producer has not named them yet
            return
        tracked.released = True
        keys = every_rank(self.layer_keys([str(k) for k in tracked.transfer.get("keys", [])]))
        self._background("releasing transfer", tracked.transfer.get("transfer_id"),
                         lambda: self.client.release(keys))

    def _background(self, what: str, name: object, call: Callable[[], object]) -> Future[None]:
        def run() -> None:
            try:
                call()
            except Exception as exc:
                logger.warning("%s %s failed: %s", what, name, exc)

        return self._calls.submit(run)

    # --- saves ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._loads_to_start, cancels=self._cancels,
                                        hurries=self._hurries)
        self._loads_to_start, self._cancels, self._hurries = [], [], []
        if not self.saves:
            return meta
        before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:  # all their blocks
            tracked = self._track(new.req_id, new.token_ids[:new.num_prompt_tokens], new.cache_salt,
                                  new.sampling_params.kv_transfer_params)
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            before[new.req_id] = new.num_computed_tokens
        for cached in scheduler_output.scheduled_cached_reqs:  # their new blocks
            if cached.req_id in self._tracked:
                for ids, new_ids in zip(self._tracked[cached.req_id].block_ids,
                                        cached.new_block_ids, strict=True):
                    ids.extend(new_ids)
            before[cached.req_id] = cached.num_computed_tokens
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            step = self._tracked.get(req_id)
            if step is None:
                continue
            skip, step.no_save_this_step = step.no_save_this_step, False
            save = None if skip else self._save_spec(req_id, step, before[req_id] + n)
            if save is not None:
                meta.saves.append(save)
        return meta

    def _save_spec(self, req_id: str, tracked: _Tracked, computed: int) -> SaveSpec | None:
        """The chunks computed by the end of this step and not saved yet."""
        prompt_len = len(tracked.prompt_ids)
        upto = min(computed, prompt_len)
        total = -(-prompt_len // self.chunk_size) if upto == prompt_len else upto // self.chunk_size
        first = tracked.saved_chunks
        if total <= first:
            return None
        chunks = [(c, c * self.chunk_size, min((c + 1) * self.chunk_size, prompt_len))
                  for c in range(first, total)]
        tracked.saved_chunks = total
        return SaveSpec(req_id, tracked.keys, chunks, [list(ids) for ids in tracked.block_ids],
                        tracked.digests)

    def request_finished(self, request: Request,
                         block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:  # never scheduled (aborted while waiting)
            tracked = _Tracked(list(request.prompt_token_ids), request.cache_salt,
                               dict(request.sampling_params.kv_transfer_params or {}))
        self._release(tracked)  # no load happened (local hits, abort, failure): still release
        if tracked.lookup is not None:
            tracked.lookup.cancel()
        params = tracked.transfer
        if not (self.saves and params.get("do_remote_decode")) or request.status.name == "FINISHED_ABORTED":
            return False, None
        keys = tracked.keys or self.scheme.chunk_keys(tracked.prompt_ids, tracked.salt)
        layer_keys, lease_s = every_rank(self.layer_keys(keys)), self.options.lease_s
        leasing = self._background("leasing the KV of", request.request_id,
                                   lambda: self.client.lease(layer_keys, lease_s))
        # Leased before the consumer hears of it (its release must come after): ~1 ms; a store
        # that does not answer holds this step for lease_wait_s once, then fails at once.
        wait([leasing], timeout=self.options.lease_wait_s)
        # Saves of every step finish before the step returns, so the blocks can go now.
        return False, {"do_remote_prefill": True, "keys": keys,
                       "num_tokens": request.num_prompt_tokens,
                       "transfer_id": params.get("transfer_id", request.request_id),
                       "kv_store_url": self.options.store_url, "tp_size": self.scheme.world_size}

    def shutdown(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


def _source_world(transfer: dict[str, Any]) -> int:
    """The producer's tensor-parallel size: its `tp_size`, else its keys' world size (1 without
    either: a producer from before tensor parallelism)."""
    if transfer.get("tp_size"):
        return int(transfer["tp_size"])
    keys = transfer.get("keys") or []
    return world_of(str(keys[0])) if keys else 1
