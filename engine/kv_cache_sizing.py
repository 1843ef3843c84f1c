"""How many KV cache blocks an engine gets: `num_kv_blocks` when set, else what fits in
`kv_cache_gib`, else the device default.

- CPU: PDSERVE_CPU_KVCACHE_SPACE GiB when set (vLLM CPU's VLLM_CPU_KVCACHE_SPACE, for a host),
  else `cpu_kv_cache_share` of the memory available when the engine starts (MemAvailable, or
  what the container's cgroup still allows, whichever is less), divided among the
  `kv_cache_sharers` engines of the host (`pdserve up` tells each worker how many it starts), and
  never more than `max_num_seqs` requests of `max_model_len` tokens can use at once.
- CUDA: what is left of `gpu_memory_utilization * total GPU memory` after the weights, the peak
  activations of a profiled worst-case step and the memory other processes and the CUDA context
  hold (vLLM's rule).

An explicit size larger than the memory available after the weights is an error before start.
One block holds K and V of `block_size` tokens for every layer."""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.kv_layout import KVCacheLayout, make_layout, single_group

logger = logging.getLogger(__name__)
CPU_KVCACHE_SPACE_ENV = "PDSERVE_CPU_KVCACHE_SPACE"  # GiB, for every engine of a host


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers: layers * 2 (K, V) * block_size * heads * head_dim."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    available_bytes: int | None = None, cpu_budget: CpuBudget | None = None,
    most_blocks: int | None = None,
) -> int:
    """Blocks in the pool, the null block included. `available_bytes` is the CUDA device's KV
    budget (measured); `cpu_budget` the CPU's memory (the module's docstring), used when neither
    `num_kv_blocks` nor `kv_cache_gib` is set. Raises ValueError (naming the setting) when fewer
    than 2 blocks fit, or when an explicit size is more than the CPU's available memory.
    `most_blocks`: what `max_num_seqs` requests of `max_model_len` can use at once (the CPU
    default's cap; by default one group's blocks, the null block included)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(num_layers, num_kv_heads, head_dim,
                                         config.block_size, dtype)
    env_gib = _env_gib() if available_bytes is None else None
    if config.kv_cache_gib is not None or env_gib is not None:
        if config.kv_cache_gib is not None:
            gib, setting = config.kv_cache_gib, f"kv_cache_gib={config.kv_cache_gib}"
        else:
            assert env_gib is not None
            gib, setting = env_gib, f"{CPU_KVCACHE_SPACE_ENV}={env_gib}"
        if cpu_budget is not None and gib * 2**30 > cpu_budget.available_now:
            raise ValueError(
                f"{setting}: {gib:.2f} GiB of KV cache does not fit in the "
                f"{cpu_budget.available_now / 2**30:.2f} GiB of memory available after the weights "
                f"loaded: lower it (or leave it unset: the default takes a share of free memory)")
        blocks = int(gib * 2**30 // per_block)
    elif available_bytes is not None:
        blocks = max(0, available_bytes) // per_block
        setting = (f"gpu_memory_utilization={config.gpu_memory_utilization} "
                   f"({available_bytes / 2**30:.2f} GiB left for the KV cache)")
    else:
        budget = cpu_budget or CpuBudget.measure()
        share = budget.at_start * config.cpu_kv_cache_share / config.kv_cache_sharers
        blocks = int(min(share, budget.available_now) // per_block)
        most = most_blocks or config.max_num_seqs * -(-config.model_len // config.block_size) + 1
        setting = (f"cpu_kv_cache_share={config.cpu_kv_cache_share} of "
                   f"{budget.at_start / 2**30:.2f} GiB available at start / kv_cache_sharers="
                   f"{config.kv_cache_sharers}")
        if blocks > most:
            blocks, setting = most, setting + f", capped at {most} blocks ({config.max_num_seqs} " \
                f"requests of {config.model_len} tokens)"
        logger.info("CPU KV cache: %d blocks (%.2f GiB): %s", blocks, blocks * per_block / 2**30,
                    setting)
    if blocks < 2:
        raise ValueError(
            f"{setting} holds {blocks} KV blocks of {per_block} bytes; at least 2 are needed "
            f"(one is the null block): raise kv_cache_gib, cpu_kv_cache_share or "
            f"gpu_memory_utilization, or free memory")
    return blocks


def _env_gib() -> float | None:
    raw = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, got {raw!r}")
    return gib


@dataclass(frozen=True)
class CpuBudget:
    """Memory available to this engine on the CPU, in bytes: when it started (before the weights
    loaded) and now."""

    at_start: int
    available_now: int

    @staticmethod
    def measure(at_start: int | None = None) -> CpuBudget:
        now = cpu_available_bytes()
        return CpuBudget(now if at_start is None else at_start, now)


def cpu_available_bytes() -> int:
    """MemAvailable (/proc/meminfo), or what this process's memory cgroup still allows when that
    is less: a container's limit, not the host's free memory. A worker restarted after the
    others' caches filled sees less free memory, and so takes a smaller share."""
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil  # not Linux: psutil's view of the same number

    return int(psutil.virtual_memory().available)


def _cgroup_room() -> int | None:
    """What this process's memory cgroup still allows (limit - usage), or None when unlimited or
    unknown. cgroup v2 (memory.max under the process's own cgroup), else v1 (the memory
    controller's mount, which in a container is the container's own group)."""
    try:
        rel = next(line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, ValueError, StopIteration):
        pass
    try:
        v1 = Path("/sys/fs/cgroup/memory")
        limit_v1 = int((v1 / "memory.limit_in_bytes").read_text())
        if limit_v1 >= 2**60:  # v1 spells "unlimited" as a page-rounded 2**63
            return None
        return max(0, limit_v1 - int((v1 / "memory.usage_in_bytes").read_text()))
    except (OSError, ValueError):
        return None


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


def engine_kv_blocks(config: EngineConfig, model: Any, layout: KVCacheLayout, dtype: torch.dtype,
                device: torch.device, free_before_load: int | None) -> int:
    """KV blocks for this engine; on CUDA without an explicit size, profiled (vLLM's rule)."""
    available, cpu_budget = None, None
    if device.type == "cpu":
        assert free_before_load is not None
        cpu_budget = CpuBudget.measure(at_start=free_before_load)
    elif device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_gib is None:
        from engine.gpu_profile import run_profile_step
        from engine.kv_cache_sizing import profile_gpu_memory

        assert free_before_load is not None
        profile = profile_gpu_memory(device, free_before_load,
                                     lambda: run_profile_step(model, config, dtype, device))
        available = profile.kv_budget(config.gpu_memory_utilization)
        logger.info("GPU memory: %s -> %.2f GiB for the KV cache", profile, available / 2**30)
    # a block is a page of `layers_per_block` layers (all of them, unless the model is hybrid)
    # on the CPU the ranks of a tensor-parallel engine share this host's memory: every rank's
    # shard of a block counts
    shard = getattr(model, "shard", None)
    kv_heads = model.num_kv_heads
    if shard is not None and device.type == "cpu":
        from engine.parallel.shard import kv_head_range

        kv_heads = sum(kv_head_range(shard.full.num_kv_heads, shard.size, r)[1] for r in range(shard.size))
    return num_kv_blocks(config, layout.layers_per_block, kv_heads, model.head_dim, dtype,
                         available_bytes=available, cpu_budget=cpu_budget,
                         most_blocks=config.max_num_seqs * layout.blocks_for_one_request(
                             config.model_len, config.block_size, config.max_num_batched_tokens) + 1)


def kv_layout(model: Any, config: EngineConfig) -> KVCacheLayout:
    """How the model's layers share KV blocks (engine/core/kv_layout.py). Windowed layers free
    the blocks their window has left (Mistral: every layer; hybrid Gemma 2/3: the local layers'
    groups, while the global layers keep theirs), except where a connector saves the prompt's
    KV (a producer saves each chunk from its blocks once computed, which may be after later
    chunks were scheduled: one group, kept whole); a consumer loads only what its first computed
    token's window reaches, then frees as it decodes."""
    windows = tuple(getattr(model, "sliding_windows", ()) or (None,) * model.num_layers)
    saves = config.kv_connector is not None and config.kv_role != "kv_consumer"
    if config.disable_hybrid_kv_cache_manager and any(w is None for w in windows):
        return single_group(len(windows))
    return make_layout(windows, free_windowed=not saves)


def fit_model_len(config: EngineConfig, num_blocks: int, layout: KVCacheLayout,
                   model_limit: int) -> EngineConfig:
    """Where no max_model_len was asked for and the KV cache cannot hold one request of the
    model's own limit, the longest request the cache holds, said in the log (vLLM stops with an
    error here instead)."""
    def fits(n: int) -> bool:
        return layout.blocks_for_one_request(n, config.block_size,
                                             config.max_num_batched_tokens) <= num_blocks - 1

    if fits(config.model_len):
        return config
    lo, hi = 0, config.model_len  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    holds = lo
    if holds < 1:
        return config  # nothing fits: _check_cache_holds_one_request says so
    logger.warning("the KV cache (%d blocks of %d tokens) cannot hold one request of the model's "
                   "limit %d: serving max_model_len=%d (set --max-model-len, or raise the KV "
                   "cache size, to choose)", num_blocks - 1, config.block_size, model_limit, holds)
    return replace(config, max_model_len=holds)


def check_cache_holds_one_request(config: EngineConfig, num_blocks: int,
                                   layout: KVCacheLayout) -> None:
    # a windowed group holds its window's blocks and one step's new tokens, at most
    needed = layout.blocks_for_one_request(config.model_len, config.block_size,
                                           config.max_num_batched_tokens)
    if num_blocks - 1 < needed:
        pages = ("" if not layout.is_hybrid else
                 f"; this hybrid model's blocks are pages of {layout.layers_per_block} layers, "
                 f"{layout.num_groups} KV cache groups each taking their own")
        raise ValueError(
            f"the KV cache ({num_blocks - 1} usable blocks of {config.block_size} tokens) cannot "
            f"hold one request of max_model_len={config.model_len} ({needed} blocks{pages}): "
            f"raise kv_cache_gib / num_kv_blocks or lower max_model_len")


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero KV cache tensor. On the CPU it lies in an anonymous memory map: the kernel hands
    out zero pages as they are first written, so a cache of many GiB (the CPU default is a share
    of free memory) costs nothing at start and memory only as blocks are used, where
    `torch.zeros` would write every byte up front (~9 s for 11 GiB on 2 cores)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)  # keeps `area` alive


def shared_cache_file(nbytes: int) -> int:
    """A file descriptor of `nbytes` of anonymous shared memory (memfd: not /dev/shm, whose size
    a container caps), for a tensor-parallel rank's KV cache that rank 0 maps too. Pages are
    allocated as they are first written, as for `zeroed_cache`."""
    fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
    os.ftruncate(fd, max(1, nbytes))
    return fd


def mapped_caches(fd: int, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zero KV cache tensors of `shape`, side by side in the shared memory of `fd`."""
    each = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    area = mmap.mmap(fd, max(1, each * count), flags=mmap.MAP_SHARED,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive
    return [flat[i * each:(i + 1) * each].view(dtype).view(shape) for i in range(count)]
