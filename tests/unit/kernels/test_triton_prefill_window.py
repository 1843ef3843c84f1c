"""The Triton paged prefill kernel with a sliding window and a logit soft cap, against its reference
and a dense float64 computation; freed (null, NaN) blocks before every window are never read.

Runs in Triton's interpreter on CPU tensors without CUDA (tests/conftest.py), so the cases are
small (head_dim 16, 16-row tiles). Windows: 1, under a key tile (5), not a multiple of the tile or
the block (21), longer than any context (1000); tiles of 16 keys over blocks of 4 or 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from tests.unit.engine.attention.window_cases import Batch, dense_batch, free_out_of_window, make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
BATCHES = {  # (cached context, new tokens) per request
    "fresh": [(0, 40), (0, 7)],
    "chunked": [(20, 17), (45, 9)],
    "mixed": [(0, 24), (30, 1), (5, 0), (64, 1), (12, 7)],
}


def run(batch: Batch, window: int | None, cap: float | None, cache: torch.Tensor | None = None,
        block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    return paged_prefill_attention(*batch.kernel_args(cache), scale=SCALE,
                                   max_query_len=batch.metadata.max_query_len, sliding_window=window,
                                   logits_soft_cap=cap, block_m=block_m, block_n=block_n)


def reference(batch: Batch, window: int | None, cap: float | None) -> torch.Tensor:
    return paged_prefill_attention_reference(*batch.kernel_args(), scale=SCALE, sliding_window=window,
                                             logits_soft_cap=cap)


@pytest.mark.parametrize("name, window, cap, heads", [
    ("fresh", 1, None, (4, 2)),
    ("fresh", 5, 3.0, (4, 4)),
    ("chunked", 21, None, (8, 2)),
    ("chunked", 5, 3.0, (4, 2)),
    ("chunked", None, 3.0, (4, 2)),
    ("mixed", 21, 3.0, (4, 2)),
    ("mixed", 1000, None, (8, 2)),
    ("mixed", 1, 3.0, (4, 1)),
])
def test_matches_reference_and_dense(name: str, window: int | None, cap: float | None,
                                     heads: tuple[int, int]) -> None:
    batch = make_batch(BATCHES[name], 16, heads[0], heads[1], 16, seed=len(name), device=DEVICE)
    got = run(batch, window, cap)
    want = reference(batch, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(want.double().cpu(), dense_batch(batch, SCALE, window, cap),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, block_m", [(3, 16), (13, 32)])
def test_freed_blocks_before_every_window_are_never_read(window: int, block_m: int) -> None:
    """Blocks of 4 tokens under 16-key tiles: the tile holding a window's start also spans freed
    blocks, which must not be loaded (NaN * 0 is NaN)."""
    batch = make_batch([(37, 1), (26, 6), (50, 19), (0, 30)], 4, 4, 2, 16, seed=window, device=DEVICE)
    freed, nulled = free_out_of_window(batch, window)
    assert nulled > 10
    got = run(freed, window, 2.0, cache=freed.written_cache(), block_m=block_m)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double().cpu(), dense_batch(batch, SCALE, window, 2.0),
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_with_window_and_cap() -> None:
    batch = make_batch(BATCHES["mixed"], 16, 8, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    torch.testing.assert_close(run(batch, 21, 5.0), reference(batch, 21, 5.0), atol=2e-2, rtol=2e-2)


def test_bad_options_are_rejected() -> None:
    batch = make_batch(BATCHES["fresh"], 16, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        run(batch, -1, None)
    with pytest.raises(ValueError, match="soft_cap"):
        run(batch, None, float("inf"))


def check_real_shape(reqs: int, length: int, heads: int, kv_heads: int, d: int, window: int, cap: float,
                     device: str) -> None:
    """Fresh bf16 prefills of `length` tokens under a window and a cap, against dense float32
    attention on unpaged copies of the same data."""
    batch = make_batch([(0, length)] * reqs, 16, heads, kv_heads, d, dtype=torch.bfloat16, device=device)
    scale = d ** -0.5
    got = paged_prefill_attention(*batch.kernel_args(), scale=scale, max_query_len=length,
                                  sliding_window=window, logits_soft_cap=cap)
    q = batch.query.float().view(reqs, length, heads, d).transpose(1, 2)  # [reqs, heads, L, d]
    k, v = (t.float().view(reqs, length, kv_heads, d).repeat_interleave(heads // kv_heads, 2).transpose(1, 2)
            for t in (batch.key, batch.value))
    scores = cap * torch.tanh(q @ k.transpose(-1, -2) * scale / cap)
    pos = torch.arange(length, device=device)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    want = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(got.float().view(reqs, length, heads, d), want.transpose(1, 2),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_windowed_capped_prefill_at_a_real_model_shape() -> None:
    """Gemma-2-like local layer: 4 x 2048-token prompts, 16 heads, 8 kv heads, d 128, window
    1024 (so whole key tiles before each tile's window are skipped), cap 50."""
    check_real_shape(4, 2048, 16, 8, 128, 1024, 50.0, "cuda")
