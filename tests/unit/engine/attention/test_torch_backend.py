"""TorchAttentionBackend against the naive float64 reference over mixed paged batches."""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, reference_paged_attention

HEAD_DIM = 8


def _batch(reqs: list[tuple[int, int]], block_size: int, holes: bool, seed: int):
    """Metadata for requests given as (cached context, new tokens), with shuffled block ids.
    With `holes`, every third new token has slot -1 (not written); `true_slots` tells where
    such a token's K/V lives (already present, as after a prefix-cache load)."""
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, true_slots, q_lens, s_lens = [], [], [], [], []
    for ctx, new in reqs:
        blocks = [free.pop() for _ in range(-(-(ctx + new) // block_size))]
        tables.append(blocks)
        for p in range(ctx, ctx + new):
            slot = blocks[p // block_size] * block_size + p % block_size
            slots.append(-1 if holes and len(slots) % 3 == 2 else slot)
            true_slots.append(slot)
        q_lens.append(new)
        s_lens.append(ctx + new)
    table = torch.zeros(len(reqs), max(len(t) for t in tables), dtype=torch.int32)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(blocks)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32), block_table=table,
        max_query_len=max(q_lens), max_seq_len=max(s_lens), query_lens_cpu=q_lens, seq_lens_cpu=s_lens,
    )
    return metadata, num_blocks, true_slots


def _place_skipped(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   metadata: AttentionMetadata, true_slots: list[int]) -> None:
    """A skipped token's (slot -1) K/V is already in the cache, as after a prefix-cache load."""
    block_size = cache.shape[2]
    for t, (slot, true_slot) in enumerate(zip(metadata.slot_mapping.tolist(), true_slots, strict=True)):
        if slot < 0:
            cache[true_slot // block_size, 0, true_slot % block_size] = k[t]
            cache[true_slot // block_size, 1, true_slot % block_size] = v[t]


MIXES = {
    "pure_prefill": [(0, 7), (0, 1), (0, 19)],
    "chunked_with_context": [(5, 7), (12, 3), (1, 9)],
    "pure_decode": [(6, 1), (17, 1), (1, 1), (31, 1)],
    "everything": [(0, 11), (9, 1), (4, 6), (0, 1), (22, 1), (13, 13)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("holes", [False, True])
def test_backend_matches_reference(block_size, num_heads, num_kv_heads, mix, holes) -> None:
    metadata, num_blocks, true_slots = _batch(MIXES[mix], block_size, holes, seed=block_size + num_heads)
    torch.manual_seed(0)
    n = sum(metadata.query_lens_cpu)
    q = torch.randn(n, num_heads, HEAD_DIM)
    k = torch.randn(n, num_kv_heads, HEAD_DIM)
    v = torch.randn(n, num_kv_heads, HEAD_DIM)
    # a cache pre-filled with random "earlier" K/V (the cached context)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, HEAD_DIM)
    _place_skipped(cache, k, v, metadata, true_slots)
    ref_cache = cache.double().clone()
    ref = reference_paged_attention(q.double(), k.double(), v.double(), ref_cache, metadata, 0.3)

    out = TorchAttentionBackend().forward(q, k, v, cache, metadata, 0.3)

    assert out.shape == q.shape
    assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert_close(cache.double(), ref_cache, atol=0, rtol=0)


def test_skipped_slots_leave_the_cache_untouched() -> None:
    metadata, num_blocks, _ = _batch([(0, 6)], block_size=4, holes=True, seed=1)
    cache = torch.zeros(num_blocks, 2, 4, 1, HEAD_DIM)
    k = torch.ones(6, 1, HEAD_DIM)
    TorchAttentionBackend().forward(torch.ones(6, 1, HEAD_DIM), k, k, cache, metadata, 1.0)
    written = int((cache != 0).any(dim=-1).sum())
    assert written == 2 * 4  # 4 of 6 tokens (slots 2 and 5 are -1), K and V each
    assert not cache[0].any()  # the null block is never written


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("holes", [False, True])
def test_bf16_backend_takes_the_cpu_kernels_and_matches_reference(
        block_size: int, mix: str, holes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with AVX512-BF16: decode rows through the paged-decode kernel, every
    multi-token request through the paged-prefill kernel (one call per layer), within bf16
    rounding of the float64 reference."""
    from kernels.cpu import paged_prefill

    if not paged_prefill.supports(6, 2, 64, block_size):
        pytest.skip("needs a C compiler and a CPU with AVX512-BF16")
    calls: list[list[int]] = []
    kernel = paged_prefill.paged_prefill

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(list(args[4]))  # q_len of each request it took
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_prefill, "paged_prefill", counted)
    metadata, num_blocks, true_slots = _batch(MIXES[mix], block_size, holes, seed=block_size)
    torch.manual_seed(1)
    n = sum(metadata.query_lens_cpu)
    q, k, v = (torch.randn(n, h, 64).bfloat16() for h in (6, 2, 2))
    cache = torch.randn(num_blocks, 2, block_size, 2, 64).bfloat16()
    _place_skipped(cache, k, v, metadata, true_slots)
    ref_cache = cache.double().clone()
    ref = reference_paged_attention(q.double(), k.double(), v.double(), ref_cache, metadata, 0.125)
    out = TorchAttentionBackend().forward(q, k, v, cache, metadata, 0.125)
    assert out.dtype == torch.bfloat16
    assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    multi = [q_len for q_len in metadata.query_lens_cpu if q_len > 1]
    assert calls == ([multi] if multi else [])


def test_a_pure_decode_step_checks_its_inputs_once_and_each_new_step_again() -> None:
    """Pure decode steps take the kernel with the step's inputs checked at its first layer;
    the other layers of the step skip the checks, and a new step's metadata is checked again
    (here: a block table too short for its lengths is refused, not read out of bounds)."""
    from kernels.cpu import paged_decode

    if not paged_decode.available():
        pytest.skip("needs a C compiler")
    backend = TorchAttentionBackend()
    metadata, num_blocks, _ = _batch(MIXES["pure_decode"], 16, False, seed=3)
    torch.manual_seed(2)
    q, k, v = (torch.randn(4, h, 64) for h in (6, 2, 2))
    caches = [torch.randn(num_blocks, 2, 16, 2, 64) for _ in range(3)]
    for cache in caches:  # three layers of one step
        ref_cache = cache.double().clone()
        ref = reference_paged_attention(q.double(), k.double(), v.double(), ref_cache, metadata, 0.125)
        assert_close(backend.forward(q, k, v, cache, metadata, 0.125).double(), ref,
                     atol=1e-5, rtol=1e-5)
    bad, _, _ = _batch(MIXES["pure_decode"], 16, False, seed=3)
    bad.block_table = bad.block_table[:, :1]  # covers 16 tokens; a request has 32
    with pytest.raises(ValueError, match="longer than its block table"):
        backend.forward(q, k, v, caches[0], bad, 0.125)
