"""Builds the KV store connector's two halves for an engine core."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.connector.keys import key_scheme
from engine.connector.kvstore_scheduler import KVStoreConnectorScheduler, StoreConnectorOptions
from engine.connector.kvstore_worker import KVStoreConnectorWorker


def make_kvstore_connector(config: EngineConfig, num_layers: int
                           ) -> tuple[KVStoreConnectorScheduler, KVStoreConnectorWorker]:
    from kvstore.client import KVStoreClient
    from kvstore.integrity import load_key as load_integrity_key

    def client(timeout_s: float = config.kv_store_timeout_s) -> KVStoreClient:
        return KVStoreClient(config.kv_store_url, timeout_s=timeout_s, breaker_s=config.kv_store_timeout_s)

    options = StoreConnectorOptions(config.kv_role, num_layers, config.kv_lease_s, config.kv_store_url,
                                    config.kv_load_mode, config.kv_layerwise_max_tokens,
                                    lease_wait_s=config.kv_store_control_timeout_s,
                                    block_size=config.block_size, await_s=config.kv_await_s,
                                    await_poll_s=config.kv_await_poll_s)
    # its calls run beside the engine's loop, which waits on none of them long: short ones
    sched = KVStoreConnectorScheduler(client(config.kv_store_control_timeout_s), key_scheme(config), options)
    worker = KVStoreConnectorWorker(client, config.kv_chunk_size, config.kv_stream_layers,
                                    save_wait_s=config.kv_save_wait_s,
                                    integrity_key=load_integrity_key(),
                                    load_wait_s=config.kv_load_wait_s,
                                    breaker_s=config.kv_store_timeout_s,
                                    world=config.tensor_parallel_size)
    return sched, worker
