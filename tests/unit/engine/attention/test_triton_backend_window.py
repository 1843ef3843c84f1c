"""TritonAttentionBackend with a sliding window and a logit soft cap: pure decode steps (the decode
kernel) and mixed steps (the prefill kernel) against dense float64 attention, freed blocks never
read. Runs in Triton's interpreter on CPU tensors without CUDA (tests/conftest.py); small cases."""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import TritonAttentionBackend
from tests.unit.engine.attention.window_cases import Batch, dense_batch, free_out_of_window, make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.25
STEPS = {
    "decode": [(0, 1), (13, 1), (40, 1)],
    "mixed": [(0, 9), (22, 1), (7, 5), (35, 1)],
}


def forward(batch: Batch, window: int | None, cap: float | None) -> torch.Tensor:
    return TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.clone_cache(),
                                            batch.metadata, SCALE, sliding_window=window,
                                            logits_soft_cap=cap)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("window, cap", [(6, None), (1, 2.5), (None, 2.5)])
def test_backend_matches_dense(step: str, window: int | None, cap: float | None) -> None:
    batch = make_batch(STEPS[step], 8, 4, 2, 16, seed=7, device=DEVICE)
    got = forward(batch, window, cap)
    torch.testing.assert_close(got.double().cpu(), dense_batch(batch, SCALE, window, cap),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("step", sorted(STEPS))
def test_freed_blocks_are_never_read(step: str) -> None:
    batch = make_batch(STEPS[step], 4, 4, 2, 16, seed=3, device=DEVICE)
    freed, nulled = free_out_of_window(batch, 5)
    assert nulled > 0
    got = forward(freed, 5, 2.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double().cpu(), dense_batch(batch, SCALE, 5, 2.5), atol=2e-5, rtol=2e-5)
