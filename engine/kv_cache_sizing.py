"""How many KV cache blocks an engine gets: `num_kv_blocks` when set, else what fits in
`kv_cache_gib`, else the device default: 1 GiB on the CPU; on CUDA, what is left of
`gpu_memory_utilization * total GPU memory` after the weights, the peak activations of a
profiled worst-case step and the memory other processes and the CUDA context hold (vLLM's
rule). One block holds K and V of `block_size` tokens for every layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import CPU_DEFAULT_KV_CACHE_GIB, EngineConfig


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers: layers * 2 (K, V) * block_size * heads * head_dim."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    available_bytes: int | None = None,
) -> int:
    """Blocks in the pool, the null block included. `available_bytes` is the device's KV
    budget (CUDA, measured) used when neither `num_kv_blocks` nor `kv_cache_gib` is set.
    Raises ValueError (naming the setting) when fewer than 2 blocks fit."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(num_layers, num_kv_heads, head_dim,
                                         config.block_size, dtype)
    if config.kv_cache_gib is not None or available_bytes is None:
        gib = config.kv_cache_gib if config.kv_cache_gib is not None else CPU_DEFAULT_KV_CACHE_GIB
        blocks = int(gib * 2**30 // per_block)
        setting = f"kv_cache_gib={gib}"
    else:
        blocks = max(0, available_bytes) // per_block
        setting = (f"gpu_memory_utilization={config.gpu_memory_utilization} "
                   f"({available_bytes / 2**30:.2f} GiB left for the KV cache)")
    if blocks < 2:
        raise ValueError(
            f"{setting} holds {blocks} KV blocks of {per_block} bytes; at least 2 are needed "
            f"(one is the null block): raise kv_cache_gib or gpu_memory_utilization")
    return blocks


@dataclass(frozen=True)
class GpuMemoryProfile:
    """What a profiled step measured on one CUDA device, in bytes."""

    total: int
    used_by_others: int  # by other processes before this engine started
    peak_torch: int  # torch's peak allocation: weights + the worst step's activations
    non_torch: int  # CUDA context, cuBLAS workspaces, ... (not seen by torch's allocator)

    def kv_budget(self, utilization: float) -> int:
        return int(self.total * utilization) - self.used_by_others - self.peak_torch - self.non_torch


def profile_gpu_memory(device: torch.device, free_before_load: int,
                       run_worst_step: Callable[[], int]) -> GpuMemoryProfile:
    """Runs `run_worst_step` (a forward of max_num_batched_tokens plus sampling of max_num_seqs
    rows, with a throwaway cache whose bytes it returns) and measures the peak without that
    cache. `free_before_load` is `torch.cuda.mem_get_info()[0]` taken before the weights were
    loaded."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    throwaway = run_worst_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - throwaway
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free_before_load
    non_torch = max(0, (total - free) - used_by_others - torch.cuda.memory_reserved(device))
    return GpuMemoryProfile(total, used_by_others, peak, non_torch)
