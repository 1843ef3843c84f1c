"""The compiled CPU paged-decode kernel with a sliding window and a logit soft cap, against its
PyTorch reference and a dense float64 computation; freed (null, NaN) blocks are never read."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.paged_decode import available, paged_decode, paged_decode_reference
from tests.unit.engine.attention.window_cases import Batch, dense_batch, free_out_of_window, make_batch

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: kernel not built")

SCALE = 0.2
# decode requests: context lengths around block edges, and one long context
CONTEXTS = [0, 3, 15, 16, 17, 40, 700]


def decode_batch(block_size: int, heads: tuple[int, int], head_dim: int = 64, seed: int = 0) -> Batch:
    return make_batch([(c, 1) for c in CONTEXTS], block_size, heads[0], heads[1], head_dim, seed=seed)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 37, 10_000])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_kernel_matches_reference_and_dense(window: int | None, cap: float | None,
                                            heads: tuple[int, int]) -> None:
    batch = decode_batch(16, heads, seed=heads[1])
    cache, md = batch.written_cache(), batch.metadata
    got = paged_decode(batch.query, cache, md.block_table, md.seq_lens, SCALE, window, cap)
    want = paged_decode_reference(batch.query, cache, md.block_table, md.seq_lens, SCALE, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    dense = dense_batch(batch, SCALE, window or None, cap or None)
    torch.testing.assert_close(want.double(), dense, atol=1e-5, rtol=1e-5)


def test_zero_window_and_cap_mean_off() -> None:
    batch = decode_batch(16, (8, 2))
    cache, md = batch.written_cache(), batch.metadata
    plain = paged_decode(batch.query, cache, md.block_table, md.seq_lens, SCALE)
    torch.testing.assert_close(paged_decode(batch.query, cache, md.block_table, md.seq_lens, SCALE, 0, 0.0),
                               plain, atol=0, rtol=0)
    torch.testing.assert_close(
        paged_decode_reference(batch.query, cache, md.block_table, md.seq_lens, SCALE, 0, 0.0),
        paged_decode_reference(batch.query, cache, md.block_table, md.seq_lens, SCALE), atol=0, rtol=0)


@pytest.mark.parametrize("window", [1, 7, 16, 33])
@pytest.mark.parametrize("threads", [1, 4])
def test_freed_blocks_before_the_window_are_never_read(window: int, threads: int) -> None:
    """Threads 4 > requests 2 also runs the per-kv-head split."""
    batch = make_batch([(700, 1), (45, 1)] if threads == 4 else [(c, 1) for c in CONTEXTS],
                       16, 8, 2, 64, seed=window)
    freed, nulled = free_out_of_window(batch, window)
    assert nulled > 0
    md = freed.metadata
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode(freed.query, freed.written_cache(), md.block_table, md.seq_lens, SCALE,
                           sliding_window=window, logits_soft_cap=2.0)
    finally:
        torch.set_num_threads(before)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), dense_batch(batch, SCALE, window, 2.0), atol=1e-5, rtol=1e-5)
    ref = paged_decode_reference(freed.query, freed.written_cache(), md.block_table, md.seq_lens, SCALE,
                                 window, 2.0)
    assert not ref.isnan().any()


@pytest.mark.parametrize("window, cap, message", [(-1, None, "sliding_window"), (None, -1.0, "soft_cap"),
                                                  (None, float("nan"), "soft_cap")])
def test_bad_options_are_rejected(window: int | None, cap: float | None, message: str) -> None:
    batch = decode_batch(16, (4, 4))
    md = batch.metadata
    with pytest.raises(ValueError, match=message):
        paged_decode(batch.query, batch.cache, md.block_table, md.seq_lens, SCALE, window, cap)
