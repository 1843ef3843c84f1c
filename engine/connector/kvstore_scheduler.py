"""Scheduler half of the KV store connector (no tensors).

Keys: a prompt is cut into chunks of `kv_chunk_size` tokens, each keyed by LMCache's chunk hash
chain (`CacheEngineKey` strings; the worker appends the layer), so any engine of the same model
finds prefixes that any other engine saved (cross-instance reuse). Producers (and `kv_both`)
save every prompt chunk once it is computed; a finished `do_remote_decode` request returns
`kv_transfer_params` (keys, token count, transfer id) and leases its objects in the store so
they survive until the consumer acknowledges (releases) them or the lease expires. Consumers
load either what `do_remote_prefill` params name or the longest prefix found in the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.connector.base import KVConnectorOutput, KVConnectorScheduler
from engine.connector.kvstore_meta import KVStoreConnectorMetadata, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from engine.core.outputs import SchedulerOutput
    from engine.core.request import Request

logger = logging.getLogger(__name__)


class KVStoreConnectorScheduler(KVConnectorScheduler):
    def __init__(self, role: str, client: Any, model_name: str, dtype: str, num_layers: int,
                 chunk_size: int, lease_s: float, store_url: str,
                 get_request: Callable[[str], Request | None],
                 get_block_ids: Callable[[str], list[int]], load_mode: str = "async",
                 layerwise_max_tokens: int = 0) -> None:
        self.role = role
        self.client = client
        self.model_name = model_name
        self.dtype = dtype
        self.num_layers = num_layers
        self.chunk_size = chunk_size
        self.lease_s = lease_s
        self.store_url = store_url
        self._get_request = get_request
        self._get_block_ids = get_block_ids
        self.load_mode = load_mode  # "async", "layerwise" or "auto" (see EngineConfig)
        self.layerwise_max_tokens = layerwise_max_tokens
        self._pending_load: dict[str, LoadSpec] = {}
        self._loads_to_start: list[LoadSpec] = []
        self._loading: dict[str, LoadSpec] = {}
        self._chunk_keys: dict[str, list[str]] = {}
        self._saved_chunks: dict[str, int] = {}
        self._found: dict[str, int] = {}  # store lookups, once per request
        self._released: set[str] = set()  # transfers this consumer acknowledged
        self._no_save_this_step: set[str] = set()

    @property
    def saves(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def chunk_keys(self, request: Request) -> list[str]:
        """The request's prompt chunk keys; a salted request's chain starts from its salt."""
        keys = self._chunk_keys.get(request.request_id)
        if keys is None:
            from kvstore.lmcache_format import NONE_HASH, CacheEngineKey, chunk_hashes, salt_prefix_hash

            salt = request.cache_salt
            first = salt_prefix_hash(salt) if salt is not None else NONE_HASH
            keys = [CacheEngineKey(self.model_name, 1, 0, h, self.dtype).to_string()
                    for h in chunk_hashes(request.prompt_token_ids, self.chunk_size,
                                          save_unfull_chunk=True, prefix_hash=first)]
            self._chunk_keys[request.request_id] = keys
        return keys

    def layer_keys(self, chunk_keys: list[str]) -> list[str]:
        return [f"{k}@{layer}" for k in chunk_keys for layer in range(self.num_layers)]

    # --- loads ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.loads:
            return 0, False
        params = request.sampling_params.kv_transfer_params or {}
        limit = request.num_tokens - 1  # the last token is always computed here (logits)
        if params.get("do_remote_prefill"):
            keys = [str(k) for k in params.get("keys", [])]
            available = min(int(params.get("num_tokens", 0)), len(keys) * self.chunk_size)
        else:
            keys = self.chunk_keys(request)
            found = self._found.get(request.request_id)
            if found is None:  # one lookup per request, not one per step it waits
                last_layer = [f"{k}@{self.num_layers - 1}" for k in keys]
                try:
                    found = int(self.client.lookup(last_layer))
                except Exception as exc:  # an unreachable store means "compute"
                    logger.warning("kv store lookup failed, computing locally: %s", exc)
                    found = 0
                self._found[request.request_id] = found
            available = min(found * self.chunk_size, request.num_prompt_tokens)
        end = min(available, limit)
        if end <= num_computed_tokens:
            return 0, False
        layerwise = self._layerwise(end - num_computed_tokens)
        self._pending_load[request.request_id] = LoadSpec(request.request_id, keys,
                                                          num_computed_tokens, end,
                                                          layerwise=layerwise)
        return end - num_computed_tokens, not layerwise

    def _layerwise(self, tokens: int) -> bool:
        """Whether a load of `tokens` tokens goes inside the step that schedules it."""
        if self.load_mode == "auto":
            return tokens <= self.layerwise_max_tokens
        return self.load_mode == "layerwise"

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        spec = self._pending_load.pop(request.request_id, None)
        if spec is None or num_external_tokens == 0:
            return
        spec.block_ids = list(block_ids)
        self._loads_to_start.append(spec)
        self._loading[request.request_id] = spec
        if spec.layerwise:  # what this step computes rests on the load: save it only if it held
            self._no_save_this_step.add(request.request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            spec = self._loading.pop(req_id, None)
            if spec is None:
                continue
            if req_id in output.load_errors:
                # A failed layer-wise step saved nothing; save again from the valid chunks.
                valid = output.valid_loaded_tokens.get(req_id, spec.start)
                self._saved_chunks[req_id] = 0 if spec.layerwise else valid // self.chunk_size
            else:  # what was loaded is in the store already: do not upload it again
                self._saved_chunks[req_id] = max(self._saved_chunks.get(req_id, 0),
                                                 spec.end // self.chunk_size)
            request = self._get_request(req_id)
            if request is not None:
                self._release(request)

    def _release(self, request: Request) -> None:
        """The consumer's acknowledgement of a transfer: the producer's lease on it ends."""
        params = request.sampling_params.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._released:
            return
        self._released.add(request.request_id)
        try:
            self.client.release(self.layer_keys([str(k) for k in params.get("keys", [])]))
        except Exception as exc:  # the lease still expires on its own
            logger.warning("releasing transfer %s failed: %s", params.get("transfer_id"), exc)

    # --- saves ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._loads_to_start)
        self._loads_to_start = []
        if not self.saves:
            return meta
        before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        before.update({r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_cached_reqs})
        skip, self._no_save_this_step = self._no_save_this_step, set()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._get_request(req_id)
            if request is None or req_id in skip:
                continue
            prompt_len = request.num_prompt_tokens
            upto = min(before[req_id] + n, prompt_len)
            total = -(-prompt_len // self.chunk_size) if upto == prompt_len else upto // self.chunk_size
            first = self._saved_chunks.get(req_id, 0)
            if total <= first:
                continue
            chunks = [(c, c * self.chunk_size, min((c + 1) * self.chunk_size, prompt_len))
                      for c in range(first, total)]
            self._saved_chunks[req_id] = total
            meta.saves.append(SaveSpec(req_id, self.chunk_keys(request),
                                       chunks, self._get_block_ids(req_id)))
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._release(request)  # no load happened (local hits, abort, failure): still release
        self._released.discard(req_id)
        self._found.pop(req_id, None)
        self._no_save_this_step.discard(req_id)
        self._pending_load.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._saved_chunks.pop(req_id, None)
        keys = self._chunk_keys.pop(req_id, None)
        params = request.sampling_params.kv_transfer_params or {}
        if not (self.saves and params.get("do_remote_decode")) or request.status.name == "FINISHED_ABORTED":
            return False, None
        keys = keys or self.chunk_keys(request)
        self._chunk_keys.pop(req_id, None)
        try:
            self.client.lease(self.layer_keys(keys), self.lease_s)
        except Exception as exc:
            logger.warning("leasing the KV of %s failed: %s", req_id, exc)
        # Saves of every step finish before the step returns, so the blocks can go now.
        return False, {"do_remote_prefill": True, "keys": keys,
                       "num_tokens": request.num_prompt_tokens,
                       "transfer_id": params.get("transfer_id", req_id),
                       "kv_store_url": self.store_url}
