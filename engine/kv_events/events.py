"""The events and their batch, as vLLM's `vllm.distributed.kv_events` encodes them.

Every struct is array-like (its fields in order, no names) and each event is tagged with its
class name, so a batch is `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id,
medium, lora_name], ...]]` in msgpack. Fields with defaults at the end are left out when they
hold the default, so a subscriber built on vLLM's documented example (six BlockStored fields)
and one built on vLLM's newer types (with `lora_name`, `group_idx`, ...) both decode a batch.

Block hashes are the engine's own: the 32-byte SHA-256 chain of engine/core/kv_cache_manager.py
(vLLM's `ExternalBlockHash` is `bytes | int`). `group_idx` is set only for a model with more
than one KV cache group (Gemma 2/3's full and sliding-window layers).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag=True):
    """One change to the set of blocks the engine's prefix cache can hit."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None: the first stored block starts the prompt
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared
