"""The Triton KV-cache write equals its plain-PyTorch reference.

Runs on CUDA when present, else on CPU tensors in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). Same-dtype writes are copies and must match exactly; a float32 -> float16 /
bfloat16 cast may differ by one ulp (the interpreter's fp32->bf16 cast truncates instead of
rounding to nearest), so those use atol/rtol 1e-3 (fp16) and 1.6e-2 (bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.triton.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference

CAST_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}  # atol = rtol
Mutation = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_case(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              device: str, num_blocks: int = 9, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """key and value as strided slices of a fused [tokens, q|k|v, heads, dim] buffer, a cache of
    random contents, and distinct scattered slots with every third token skipped (-1)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g).to(device, dtype)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1
    return qkv[:, 1], qkv[:, 2], kv_cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (1, 128), (3, 80)])
def test_writes_equal_reference_and_skip_holes(device: str, dtype: torch.dtype, block_size: int,
                                               num_kv_heads: int, head_dim: int) -> None:
    key, value, cache, slots = make_case(11, num_kv_heads, head_dim, block_size, dtype, device)
    want = cache.clone()
    reshape_and_cache_reference(key, value, want, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_long_rows_are_split_over_programs(device: str) -> None:
    """32 kv heads x 128 = 4096 elements per token: four programs of 1024 per token."""
    key, value, cache, slots = make_case(5, 32, 128, 16, torch.bfloat16, device, num_blocks=2)
    want = cache.clone()
    reshape_and_cache_reference(key, value, want, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_float32_keys_are_cast_to_the_cache_dtype(device: str, cache_dtype: torch.dtype) -> None:
    key, value, cache, slots = make_case(7, 2, 64, 16, torch.float32, device)
    cache = cache.to(cache_dtype)
    want = cache.clone()
    reshape_and_cache_reference(key, value, want, slots)
    reshape_and_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, want, atol=CAST_TOL[cache_dtype], rtol=CAST_TOL[cache_dtype])


def test_all_skipped_and_empty_batches_leave_the_cache_alone(device: str) -> None:
    key, value, cache, slots = make_case(4, 2, 64, 16, torch.float16, device)
    before = cache.clone()
    reshape_and_cache(key, value, cache, torch.full_like(slots, -1))
    reshape_and_cache(key[:0], value[:0], cache, slots[:0])
    assert torch.equal(cache, before)


def test_slots_past_int32_elements_of_the_cache(device: str) -> None:
    """Slots at the end of a cache of more than 2**31 elements (offsets need int64). On CPU only
    the touched pages of the 4 GiB tensor are committed, so the check reads just those slots."""
    block_size, head_dim = 16, 64
    num_blocks = 2**31 // (2 * block_size * head_dim) + 8
    cache = torch.empty(num_blocks, 2, block_size, 1, head_dim, dtype=torch.float16, device=device)
    key = torch.randn(3, 1, head_dim, device=device).half()
    value = torch.randn(3, 1, head_dim, device=device).half()
    last = num_blocks * block_size - 1
    slots = torch.tensor([last, -1, last - 20], device=device)
    reshape_and_cache(key, value, cache, slots)
    for t in (0, 2):
        block, offset = divmod(int(slots[t]), block_size)
        assert torch.equal(cache[block, 0, offset], key[t])
        assert torch.equal(cache[block, 1, offset], value[t])


def _args(device: str) -> dict[str, Any]:
    key, value, cache, slots = make_case(4, 2, 64, 16, torch.float16, device)
    return {"key": key, "value": value, "kv_cache": cache, "slot_mapping": slots}


@pytest.mark.parametrize("mutate, message", [
    (lambda a: {**a, "slot_mapping": a["slot_mapping"].int()}, "slot_mapping must be int64"),
    (lambda a: {**a, "key": a["key"].double()}, "key must be"),
    (lambda a: {**a, "value": a["value"].to(torch.int8)}, "value must be"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].double()}, "kv_cache must be"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][:, :1]}, "kv_cache must be"),
    (lambda a: {**a, "key": a["key"][:, :, :32]}, "key must have shape"),
    (lambda a: {**a, "value": a["value"][:3]}, "value must have shape"),
    (lambda a: {**a, "slot_mapping": a["slot_mapping"][:3]}, "slot_mapping must have shape"),
    (lambda a: {**a, "key": a["key"].transpose(1, 2).contiguous().transpose(1, 2)}, "key must be contig"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)},
     "kv_cache must be contiguous"),
    (lambda a: {**a, "slot_mapping": a["slot_mapping"].repeat(2)[::2]}, "slot_mapping must be contiguous"),
])
def test_bad_inputs_are_rejected_before_launch(device: str, mutate: Mutation, message: str) -> None:
    args = mutate(_args(device))
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
    assert torch.equal(args["kv_cache"], before)


def test_inputs_on_another_device_are_rejected(device: str) -> None:
    args = _args(device)
    other = "cpu" if device == "cuda" else "meta"
    with pytest.raises(ValueError, match="value must be on"):
        reshape_and_cache(**{**args, "value": args["value"].to(other)})


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="kv_cache must be a CUDA tensor"):
        reshape_and_cache(**_args("cpu"))
