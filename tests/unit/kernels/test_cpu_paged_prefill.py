"""The CPU paged prefill kernel (bf16 and float32) against its float32 PyTorch reference: fresh
prompts, chunks after cached context, every supported head_dim, GQA groups, block sizes, and a
batch of mixed requests with rows of other requests left alone. float32 is held to the decode
kernel's float32 tolerance (2e-5), bf16 to its own (p.V weights and the output in bf16)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import paged_prefill as pp

pytestmark = pytest.mark.skipif(not pp.supports(4, 2, 64, 16),
                                reason="needs a C compiler and a CPU with AVX512-BF16")


def _case(reqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
          seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for _, s in reqs) + 1
    num_blocks = len(reqs) * max_blocks + 1
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    cache[0] = float("nan")  # the null block: never read
    ids = torch.randperm(num_blocks - 1, generator=g) + 1
    table = ids[: len(reqs) * max_blocks].view(len(reqs), max_blocks).to(torch.int32).contiguous()
    tokens = sum(q for q, _ in reqs) + 3
    query = (torch.randn(tokens, heads + 2, head_dim, generator=g) * 2).to(dtype)[:, :heads]
    return query, cache, table


def _run(reqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
         seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
    query, cache, table = _case(reqs, heads, kv_heads, head_dim, block_size, seed, dtype)
    starts, at = [], 2  # two leading rows that belong to no request
    for q_len, _ in reqs:
        starts.append(at)
        at += q_len
    q_lens, seq_lens = [q for q, _ in reqs], [s for _, s in reqs]
    out = torch.full(query.shape, 7.0, dtype=dtype)
    scale = head_dim ** -0.5
    pp.paged_prefill(query, cache, table, starts, q_lens, seq_lens, scale, out)
    want = pp.paged_prefill_reference(query, cache, table, starts, q_lens, seq_lens, scale)
    for start, q_len in zip(starts, q_lens, strict=True):
        rows = slice(start, start + q_len)
        tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out[rows].float(), want[rows], **tol)
    assert bool((out[:2] == 7.0).all()) and bool((out[at:] == 7.0).all())  # others untouched


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (10, 2), (16, 2)])
def test_fresh_prompts_match_the_reference(head_dim: int, heads: int, kv_heads: int) -> None:
    _run([(1, 1), (15, 15), (16, 16), (17, 17), (70, 70)], heads, kv_heads, head_dim, 16)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_float32_prompts_match_the_reference_to_float32_rounding(head_dim: int, heads: int,
                                                                 kv_heads: int) -> None:
    _run([(1, 1), (15, 15), (16, 16), (33, 33), (70, 70)], heads, kv_heads, head_dim, 16,
         dtype=torch.float32)


@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_float32_chunks_after_cached_context_match_the_reference(block_size: int) -> None:
    _run([(5, 40), (33, 100), (16, 48), (1, 9), (200, 203)], 9, 3, 64, block_size,
         seed=block_size, dtype=torch.float32)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_chunks_after_cached_context_match_the_reference(block_size: int) -> None:
    """Queries are the last q_len positions: a prefix-cache hit, a chunked prefill's later
    chunk, a chunk ending mid-block, and a one-token request among them."""
    _run([(5, 40), (33, 100), (16, 48), (1, 9), (200, 203)], 9, 3, 64, block_size, seed=block_size)


def test_a_large_gqa_group_takes_smaller_tiles() -> None:
    _run([(40, 60)], 64, 1, 64, 16)  # 64 query heads on one kv head: 2 tokens per tile


def test_unsupported_inputs_are_refused() -> None:
    query, cache, table = _case([(4, 4)], 4, 2, 64, 16, 0)
    out = torch.empty_like(query)
    assert not pp.supports(4, 2, 48, 16) and not pp.supports(4, 2, 64, 8)
    assert not pp.supports(4, 2, 40, 16, torch.float32) and not pp.supports(4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="all three alike"):
        pp.paged_prefill(query.float(), cache, table, [0], [4], [4], 0.1, out)
    with pytest.raises(ValueError, match="bad request"):
        pp.paged_prefill(query, cache, table, [0], [5], [4], 0.1, out)
    with pytest.raises(ValueError, match="one entry per block-table row"):
        pp.paged_prefill(query, cache, table, [0, 1], [1, 1], [1, 1], 0.1, out)
