"""The compiled CPU paged-decode kernel equals its PyTorch reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu.paged_decode import available, paged_decode, paged_decode_reference, vectorized

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: kernel not built")


def make_case(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # a spare column of padding
    num_blocks = len(lens) * max_blocks + 1
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g)
    # Scattered, non-contiguous block ids; padding points at the null block 0.
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(lens) * max_blocks]
    block_table = ids.view(len(lens), max_blocks).to(torch.int32)
    for b, n in enumerate(lens):
        block_table[b, -(-n // block_size):] = 0
    query = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return query, kv_cache, block_table.contiguous(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_kernel_matches_reference_across_block_boundaries(block_size: int, head_dim: int,
                                                          num_heads: int, num_kv_heads: int) -> None:
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 700]
    q, cache, table, seq_lens = make_case(lens, num_heads, num_kv_heads, head_dim, block_size)
    want = paged_decode_reference(q, cache, table, seq_lens, head_dim ** -0.5)
    got = paged_decode(q, cache, table, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 17, 64])
def test_kernel_matches_reference_for_batches(batch: int) -> None:
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 300, (batch,), generator=g).tolist()
    q, cache, table, seq_lens = make_case(lens, 9, 3, 64, 16, seed=batch)
    torch.testing.assert_close(paged_decode(q, cache, table, seq_lens, 0.125),
                               paged_decode_reference(q, cache, table, seq_lens, 0.125),
                               atol=2e-5, rtol=1e-5)


def test_query_rows_with_a_token_stride_are_read_in_place() -> None:
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 16)
    wide = torch.zeros(2, 3, 4, 64)
    wide[:, 1] = q
    strided = wide[:, 1]  # token stride 3 * 4 * 64, rows contiguous
    torch.testing.assert_close(paged_decode(strided, cache, table, seq_lens, 0.1),
                               paged_decode_reference(q, cache, table, seq_lens, 0.1))


@pytest.mark.parametrize("mutate, message", [
    (lambda a: {**a, "query": a["query"].double()}, "float32"),
    (lambda a: {**a, "block_table": a["block_table"].long()}, "int32"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][:, :1]}, "kv_cache"),
    (lambda a: {**a, "query": a["query"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "one row per request"),
    (lambda a: {**a, "seq_lens": a["seq_lens"] * 100}, "longer than its block table"),
])
def test_bad_inputs_are_rejected_before_the_call(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 16)
    args = {"query": q, "kv_cache": cache, "block_table": table, "seq_lens": seq_lens}
    with pytest.raises(ValueError, match=message):
        paged_decode(scale=0.1, **mutate(args))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_few_requests_split_over_kv_heads_match_reference(threads: int) -> None:
    """Fewer requests than threads: the kernel splits each request over its kv heads."""
    q, cache, table, seq_lens = make_case([37, 300], 12, 4, 64, 16, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode(q, cache, table, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, paged_decode_reference(q, cache, table, seq_lens, 0.125),
                               atol=2e-5, rtol=1e-5)


def test_sizes_over_the_kernel_buffers_are_rejected() -> None:
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 128)
    with pytest.raises(ValueError, match="block_size 128"):
        paged_decode(q, cache, table, seq_lens, 0.1)


def test_loading_the_kernel_keeps_denormals() -> None:
    """Built with -ffast-math but linked without it: no flush-to-zero for the whole process."""
    assert available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0


@pytest.mark.parametrize("window, cap", [(None, None), (40, None), (None, 30.0), (100, 50.0)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 1, 256), (8, 8, 128)])
def test_a_bfloat16_cache_is_read_as_its_exact_float32_widening(
        window: int | None, cap: float | None, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """A bf16 cache gives what the float32 kernel gives on the same values widened (bf16 -> f32
    is exact), so the only difference is summation order; and the reference on the bf16 cache
    agrees. The query is bf16-valued, as a bf16 model's is (q.k may take it as bf16)."""
    lens = [1, 15, 16, 17, 203, 700]
    q, cache, table, seq_lens = make_case(lens, num_heads, num_kv_heads, head_dim, 16, seed=head_dim)
    q = q.bfloat16().float()
    half = cache.to(torch.bfloat16)
    got = paged_decode(q, half, table, seq_lens, head_dim ** -0.5, window, cap)
    torch.testing.assert_close(got, paged_decode(q, half.float(), table, seq_lens, head_dim ** -0.5,
                                                 window, cap), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, paged_decode_reference(q, half, table, seq_lens, head_dim ** -0.5,
                                                           window, cap), atol=2e-5, rtol=1e-5)


def test_a_float16_cache_is_rejected() -> None:
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode(q, cache.half(), table, seq_lens, 0.1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("window, cap", [(None, None), (37, None), (None, 20.0)])
def test_vectorized_and_generic_bodies_agree_with_the_reference(
        kv_dtype: torch.dtype, head_dim: int, block_size: int, window: int | None,
        cap: float | None) -> None:
    """The AVX-512 body (head_dim 16..256 in powers of two, where the CPU has it) and the
    portable loop give the reference's result; head_dim 48 always takes the portable loop.
    GQA groups of 5 heads per kv head split into register sub-groups for every head_dim."""
    lens = [1, block_size - 1, block_size + 1, 5 * block_size + 3, 300]
    q, cache, table, seq_lens = make_case(lens, 10, 2, head_dim, block_size, seed=head_dim + block_size)
    cache = cache.to(kv_dtype)
    q = q.bfloat16().float()
    scale = head_dim ** -0.5
    want = paged_decode_reference(q, cache, table, seq_lens, scale, window, cap)
    for generic in (False, True):
        got = paged_decode(q, cache, table, seq_lens, scale, window, cap, generic=generic)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_the_default_models_shapes_take_the_vectorized_body_on_avx512() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if " avx512f " not in (cpuinfo.read_text() if cpuinfo.exists() else ""):
        pytest.skip("this CPU has no AVX-512: the portable loop serves every shape")
    assert vectorized(64, torch.bfloat16) and vectorized(64, torch.float32)
    assert vectorized(256, torch.bfloat16) and not vectorized(48, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("window, cap", [(None, None), (37, 20.0)])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_bfloat16_query_gives_the_float32_calls_output_rounded_to_bfloat16(
        kv_dtype: torch.dtype, head_dim: int, window: int | None, cap: float | None,
        threads: int) -> None:
    """A bf16 query (read in place from strided token rows) and a bf16 output: bit for bit what
    the float32 call gives between `.float()` and `.to(torch.bfloat16)`, on the vectorized
    (head_dim 64) and the portable (48) body, whole requests and requests split over kv heads
    (2 requests on 4 threads)."""
    lens = [1, 17, 300] if threads == 1 else [23, 300]
    q, cache, table, seq_lens = make_case(lens, 10, 2, head_dim, 16, seed=head_dim)
    cache = cache.to(kv_dtype)
    wide = torch.zeros(len(lens), 3, 10, head_dim, dtype=torch.bfloat16)
    wide[:, 1] = q.bfloat16()
    query = wide[:, 1]  # token stride 3 * 10 * head_dim, rows contiguous
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode(query, cache, table, seq_lens, head_dim ** -0.5, window, cap)
        want = paged_decode(query.float(), cache, table, seq_lens, head_dim ** -0.5, window, cap)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    assert torch.equal(got, want.to(torch.bfloat16))
