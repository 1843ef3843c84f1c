"""Write this step's keys and values into the paged KV cache: token t goes to slot
slot_mapping[t] (block slot // block_size, offset slot % block_size); a slot of -1 is skipped.

The plain-PyTorch reference comes first; the Triton kernel below does the same, one program per
(token, chunk of its [num_kv_heads * head_dim] row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_rows_contiguous,
    check_shape,
    require_cuda_or_interpreter,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_CHUNK = 1024  # elements of a token row one program copies


def reshape_and_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """In place: kv_cache[slot // bs, 0, slot % bs] = key[t] (and V at index 1) for slot >= 0."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[keep].to(kv_cache.dtype)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride, value_stride,  # token strides of key / value (elements)
    cache_block_stride, cache_kv_stride, cache_slot_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,  # power of two
):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    # A skipped token (slot -1) masks every element. The condition is folded into the bound: the
    # interpreter (triton 3.9) mistypes `block_mask & scalar_mask` as int32 and rejects it.
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
    row = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride
    dst = cache_ptr + row + offs
    elem = cache_ptr.dtype.element_ty
    tl.store(dst, k.to(elem), mask=mask)
    tl.store(dst + cache_kv_stride, v.to(elem), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows contiguous, any token stride
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows contiguous, any token stride
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    num_warps: int = 4,
) -> None:
    """Same effect as `reshape_and_cache_reference`. key/value may be float16/bfloat16/float32 and
    are cast to the cache dtype. Slots must be -1 or < num_blocks * block_size (not checked: that
    would read the tensor on the host)."""
    _check_inputs(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    row = kv_cache.shape[3] * kv_cache.shape[4]
    if num_tokens == 0 or row == 0:
        return
    chunk = min(triton.next_power_of_2(row), _MAX_CHUNK)
    grid = (num_tokens, triton.cdiv(row, chunk))
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROW=row, BLOCK_SIZE=kv_cache.shape[2], CHUNK=chunk, num_warps=num_warps,
    )


def _check_inputs(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    require_cuda_or_interpreter(kv_cache, "kv_cache")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        check_device(name, t, kv_cache.device)
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
    check_dtype("key", key, FLOAT_DTYPES)
    check_dtype("value", value, FLOAT_DTYPES)
    check_dtype("slot_mapping", slot_mapping, torch.int64)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                         f"got {list(kv_cache.shape)}")
    check_contiguous("kv_cache", kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    check_shape("key", key, (None, num_kv_heads, head_dim))
    check_shape("value", value, (key.shape[0], num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    check_rows_contiguous("key", key)
    check_rows_contiguous("value", value)
    check_contiguous("slot_mapping", slot_mapping)
