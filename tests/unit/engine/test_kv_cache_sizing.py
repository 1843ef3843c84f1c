"""KV cache sizing: bytes per block and the number of blocks a config gets."""

from __future__ import annotations

import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache_sizing import (
    CPU_KVCACHE_SPACE_ENV,
    CpuBudget,
    cpu_available_bytes,
    kv_cache_bytes_per_block,
    num_kv_blocks,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_per_block_equal_one_blocks_tensors_over_all_layers(dtype: torch.dtype) -> None:
    layers, heads, head_dim, block_size = 3, 2, 8, 16
    one_layer = torch.empty(1, 2, block_size, heads, head_dim, dtype=dtype)
    expected = layers * one_layer.numel() * one_layer.element_size()
    assert kv_cache_bytes_per_block(layers, heads, head_dim, block_size, dtype) == expected


def test_smollm2_block_size_in_float32() -> None:
    # 30 layers * K and V * 16 tokens * 3 heads * 64 dims * 4 bytes
    assert kv_cache_bytes_per_block(30, 3, 64, 16, torch.float32) == 30 * 2 * 16 * 3 * 64 * 4


def test_explicit_num_kv_blocks_wins_over_gib() -> None:
    config = EngineConfig(num_kv_blocks=7, kv_cache_gib=100.0)
    assert num_kv_blocks(config, 30, 3, 64, torch.float32) == 7


def test_blocks_fill_kv_cache_gib_rounded_down() -> None:
    config = EngineConfig(kv_cache_gib=0.5, block_size=16)
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    got = num_kv_blocks(config, 30, 3, 64, torch.float32)
    assert got == (2**29) // per_block
    assert got * per_block <= 2**29 < (got + 1) * per_block


def test_half_precision_doubles_the_blocks() -> None:
    config = EngineConfig(kv_cache_gib=0.25)
    f32 = num_kv_blocks(config, 4, 2, 32, torch.float32)
    assert num_kv_blocks(config, 4, 2, 32, torch.bfloat16) == 2 * f32


def test_too_small_cache_raises_naming_kv_cache_gib() -> None:
    config = EngineConfig(kv_cache_gib=1e-6)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        num_kv_blocks(config, 30, 3, 64, torch.float32)


PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 4
GIB = 2**30


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)


def test_cpu_default_is_a_share_of_the_memory_free_at_start(no_env: None) -> None:
    budget = CpuBudget(at_start=8 * GIB, available_now=7 * GIB)
    config = EngineConfig(max_model_len=8192)
    assert num_kv_blocks(config, 30, 3, 64, torch.float32, cpu_budget=budget) == 4 * GIB // PER_BLOCK
    shared = EngineConfig(max_model_len=8192, kv_cache_sharers=4, cpu_kv_cache_share=0.8)
    assert num_kv_blocks(shared, 30, 3, 64, torch.float32, cpu_budget=budget) == \
        int(8 * GIB * 0.8 / 4) // PER_BLOCK


def test_cpu_default_never_takes_more_than_is_available_now(no_env: None) -> None:
    budget = CpuBudget(at_start=8 * GIB, available_now=GIB)
    got = num_kv_blocks(EngineConfig(max_model_len=8192), 30, 3, 64, torch.float32, cpu_budget=budget)
    assert got == GIB // PER_BLOCK


def test_cpu_default_is_capped_at_what_max_num_seqs_requests_use(no_env: None) -> None:
    budget = CpuBudget(at_start=64 * GIB, available_now=64 * GIB)
    config = EngineConfig(max_model_len=1000, max_num_seqs=4)
    assert num_kv_blocks(config, 30, 3, 64, torch.float32, cpu_budget=budget) == 4 * 63 + 1
    assert num_kv_blocks(config, 30, 3, 64, torch.float32, cpu_budget=budget, most_blocks=99) == 99


def test_the_host_setting_sets_every_engines_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.5")
    budget = CpuBudget(at_start=8 * GIB, available_now=8 * GIB)
    config = EngineConfig(max_model_len=8192)
    assert num_kv_blocks(config, 30, 3, 64, torch.float32, cpu_budget=budget) == GIB // 2 // PER_BLOCK
    explicit = EngineConfig(max_model_len=8192, kv_cache_gib=0.25)  # an engine's own size wins
    assert num_kv_blocks(explicit, 30, 3, 64, torch.float32, cpu_budget=budget) == GIB // 4 // PER_BLOCK
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, bad)
        with pytest.raises(ValueError, match=CPU_KVCACHE_SPACE_ENV):
            num_kv_blocks(config, 30, 3, 64, torch.float32, cpu_budget=budget)


def test_an_explicit_size_over_the_available_memory_fails_before_start(no_env: None) -> None:
    budget = CpuBudget(at_start=4 * GIB, available_now=2 * GIB)
    with pytest.raises(ValueError,
                       match=r"kv_cache_gib=3.0: 3.00 GiB of KV cache does not fit in the 2.00 GiB"):
        num_kv_blocks(EngineConfig(kv_cache_gib=3.0), 30, 3, 64, torch.float32, cpu_budget=budget)


def test_share_and_sharers_are_checked() -> None:
    for kw, field in (({"cpu_kv_cache_share": 0.0}, "cpu_kv_cache_share"),
                      ({"cpu_kv_cache_share": 1.0}, "cpu_kv_cache_share"),
                      ({"kv_cache_sharers": 0}, "kv_cache_sharers")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)  # type: ignore[arg-type]


def test_the_memory_probe_reads_this_host() -> None:
    assert 0 < cpu_available_bytes() <= psutil.virtual_memory().total


def test_measured_gpu_budget_is_used_when_no_size_is_given() -> None:
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    got = num_kv_blocks(EngineConfig(), 30, 3, 64, torch.float32, available_bytes=10 * per_block + 5)
    assert got == 10


def test_explicit_gib_wins_over_the_measured_budget() -> None:
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    config = EngineConfig(kv_cache_gib=0.5)
    assert num_kv_blocks(config, 30, 3, 64, torch.float32, available_bytes=per_block * 3) == (
        2**29 // per_block)


def test_no_room_on_the_gpu_names_gpu_memory_utilization() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_kv_blocks(EngineConfig(), 30, 3, 64, torch.float32, available_bytes=-5)


def test_gpu_budget_subtracts_others_peak_and_non_torch() -> None:
    from engine.kv_cache_sizing import GpuMemoryProfile

    profile = GpuMemoryProfile(total=100, used_by_others=10, peak_torch=20, non_torch=5)
    assert profile.kv_budget(0.9) == 90 - 10 - 20 - 5


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_bad_gpu_memory_utilization_is_rejected(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
