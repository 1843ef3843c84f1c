"""The Triton paged-decode kernel with a sliding window and a logit soft cap, against its reference
and a dense float64 computation; freed (null, NaN) blocks before the window are never read.

Runs in Triton's interpreter on CPU tensors without CUDA (tests/conftest.py), so the cases are
small: head_dim 16, partition 16 (several partitions and the combine kernel) or 512 (one pass).
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton.paged_decode import paged_decode_attention, paged_decode_attention_reference
from tests.unit.engine.attention.window_cases import Batch, dense_batch, free_out_of_window, make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
CONTEXTS = [0, 4, 15, 16, 40, 90]  # decode requests' cached tokens: seq_len = context + 1


def run(batch: Batch, window: int | None, cap: float | None, partition_size: int,
        max_seq_len: int | None = None, cache: torch.Tensor | None = None) -> torch.Tensor:
    md = batch.metadata
    cache = batch.written_cache() if cache is None else cache
    bound = md.max_seq_len if max_seq_len is None else max_seq_len
    return paged_decode_attention(batch.query, cache, md.block_table, md.seq_lens, SCALE, bound,
                                  sliding_window=window, logits_soft_cap=cap, partition_size=partition_size)


@pytest.mark.parametrize("window, cap",
                         [(1, None), (5, 3.0), (16, None), (37, 3.0), (1000, None), (None, 3.0)])
@pytest.mark.parametrize("partition_size", [16, 512])
def test_matches_reference_and_dense(window: int | None, cap: float | None, partition_size: int) -> None:
    batch = make_batch([(c, 1) for c in CONTEXTS], 16, 8, 2, 16, seed=window or 0, device=DEVICE)
    got = run(batch, window, cap, partition_size)
    md = batch.metadata
    want = paged_decode_attention_reference(batch.query, batch.written_cache(), md.block_table,
                                            md.seq_lens, SCALE, window, cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want.double().cpu(), dense_batch(batch, SCALE, window, cap),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 20])
def test_freed_blocks_before_the_window_are_never_read(window: int) -> None:
    """Block size 4 < tile (16 tokens): a tile starting at the window would span freed blocks
    before it if the kernel did not start at the window's first token."""
    batch = make_batch([(c, 1) for c in (9, 30, 61, 2)], 4, 4, 1, 16, seed=window, device=DEVICE)
    freed, nulled = free_out_of_window(batch, window)
    assert nulled > 5
    for partition_size in (16, 512):
        got = run(freed, window, 2.0, partition_size)
        assert not got.isnan().any()
        torch.testing.assert_close(got.double().cpu(), dense_batch(batch, SCALE, window, 2.0),
                                   atol=1e-5, rtol=1e-5)


def test_max_seq_len_far_above_the_window_under_cuda_graph_sizing() -> None:
    """max_seq_len 256 (the model's limit) with window 20: 2 partitions of 16 cover the window,
    and a request shorter than the window, or of seq_len 0, still comes out right."""
    batch = make_batch([(c, 1) for c in (0, 7, 60)], 16, 4, 2, 16, seed=1, device=DEVICE)
    md = batch.metadata
    table = torch.zeros(3, 16, dtype=torch.int32, device=DEVICE)
    table[:, : md.block_table.shape[1]] = md.block_table
    seq_lens = md.seq_lens.clone()
    seq_lens[0] = 0
    cache = batch.written_cache()
    got = paged_decode_attention(batch.query, cache, table, seq_lens, SCALE, 256, sliding_window=20,
                                 partition_size=16)
    want = paged_decode_attention_reference(batch.query, cache, table, seq_lens, SCALE, 20)
    assert got[0].eq(0).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_with_window_and_cap() -> None:
    batch = make_batch([(c, 1) for c in CONTEXTS], 16, 8, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    got = run(batch, 20, 5.0, 16)
    md = batch.metadata
    want = paged_decode_attention_reference(batch.query, batch.written_cache(), md.block_table,
                                            md.seq_lens, SCALE, 20, 5.0)
    torch.testing.assert_close(got, want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("window, cap, message", [(-3, None, "sliding_window"), (1.5, None, "sliding_window"),
                                                  (None, -1.0, "soft_cap")])
def test_bad_options_are_rejected(window: object, cap: float | None, message: str) -> None:
    batch = make_batch([(4, 1)], 16, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        run(batch, window, cap, 16)  # type: ignore[arg-type]



def check_long_contexts(reqs: int, lo: int, hi: int, heads: int, kv_heads: int, d: int, window: int,
                        max_seq_len: int, cap: float, device: str) -> None:
    """bf16 decode over contexts of lo..hi tokens, the grid sized by `max_seq_len` as under CUDA
    graphs, against the reference."""
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(lo, hi, (reqs,), generator=g).tolist()
    batch = make_batch([(c, 1) for c in contexts], 16, heads, kv_heads, d, dtype=torch.bfloat16,
                       device=device)
    md = batch.metadata
    table = torch.zeros(reqs, max_seq_len // 16, dtype=torch.int32, device=device)
    table[:, : md.block_table.shape[1]] = md.block_table
    cache = batch.written_cache()
    got = paged_decode_attention(batch.query, cache, table, md.seq_lens, SCALE, max_seq_len,
                                 sliding_window=window, logits_soft_cap=cap)
    want = paged_decode_attention_reference(batch.query, cache, table, md.seq_lens, SCALE, window, cap)
    torch.testing.assert_close(got, want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.gpu
def test_windowed_decode_at_a_real_model_shape() -> None:
    """16 requests of 3000..9000 tokens, 32 heads / 8 kv heads, d 128, window 4096 (Mistral),
    max_seq_len 16384, cap 30."""
    check_long_contexts(16, 3000, 9000, 32, 8, 128, 4096, 16384, 30.0, "cuda")
