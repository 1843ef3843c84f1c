"""Builds the KV store connector's two halves for an engine core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.connector.kvstore_scheduler import KVStoreConnectorScheduler
from engine.connector.kvstore_worker import KVStoreConnectorWorker

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler


def make_kvstore_connector(config: EngineConfig, num_layers: int, scheduler: Scheduler,
                           kv: KVCacheManager
                           ) -> tuple[KVStoreConnectorScheduler, KVStoreConnectorWorker]:
    from pathlib import Path

    from kvstore.client import KVStoreClient
    from kvstore.integrity import load_key as load_integrity_key

    def client(timeout_s: float = config.kv_store_timeout_s) -> KVStoreClient:
        return KVStoreClient(config.kv_store_url, timeout_s=timeout_s, breaker_s=config.kv_store_timeout_s)

    model_name = Path(config.model).name if Path(config.model).exists() else config.model
    sched = KVStoreConnectorScheduler(  # its calls run inside the engine's loop: short ones
        config.kv_role, client(config.kv_store_control_timeout_s), model_name, config.dtype, num_layers,
        config.kv_chunk_size,
        config.kv_lease_s, config.kv_store_url, scheduler.requests.get, kv.get_block_ids,
        load_mode=config.kv_load_mode, layerwise_max_tokens=config.kv_layerwise_max_tokens)
    worker = KVStoreConnectorWorker(client, config.kv_chunk_size, config.kv_stream_layers,
                                    save_wait_s=config.kv_save_wait_s,
                                    integrity_key=load_integrity_key())
    return sched, worker
