"""How many KV cache blocks an engine gets: `num_kv_blocks` when set, else what fits in
`kv_cache_gib`. One block holds K and V of `block_size` tokens for every layer."""

from __future__ import annotations

import torch

from engine.config import EngineConfig


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers: layers * 2 (K, V) * block_size * heads * head_dim."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Blocks in the pool, the null block included. Raises ValueError (naming kv_cache_gib)
    when `kv_cache_gib` holds fewer than 2 blocks."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(num_layers, num_kv_heads, head_dim,
                                         config.block_size, dtype)
    blocks = int(config.kv_cache_gib * 2**30 // per_block)
    if blocks < 2:
        raise ValueError(
            f"kv_cache_gib={config.kv_cache_gib} holds {blocks} KV blocks of {per_block} bytes; "
            f"at least 2 are needed (one is the null block): raise kv_cache_gib")
    return blocks
