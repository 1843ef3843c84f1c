"""Sliding window and logit soft cap in TorchAttentionBackend and `reference_paged_attention`.

Every check is against two references: the naive paged reference (float64) and plain dense masked
attention in float64 (`window_cases.dense_attention`), itself checked against transformers' own
mask functions and Gemma 2's eager attention. The backend runs float32 with the compiled decode
kernel (where built) and without it (the PyTorch decode path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from engine.attention import torch_backend
from engine.attention.torch_backend import TorchAttentionBackend, reference_paged_attention
from kernels.cpu import paged_decode as paged_decode_kernel
from tests.unit.engine.attention.window_cases import (
    Batch,
    dense_attention,
    dense_batch,
    free_out_of_window,
    make_batch,
)

SCALE = 0.35
D = 8
MIXES = {  # (cached context, new tokens) per request
    "prefill": [(0, 13), (0, 1), (0, 6)],
    "chunked": [(9, 7), (21, 3), (2, 11)],
    "decode": [(0, 1), (7, 1), (16, 1), (40, 1)],
    "mixed": [(0, 12), (19, 1), (5, 6), (33, 1), (26, 9)],
}
WINDOWS = [None, 1, 3, 6, 1000]  # off, 1, < block, not a multiple of the block, > any context


def run_backend(batch: Batch, window: int | None, cap: float | None) -> torch.Tensor:
    cache = batch.clone_cache()
    return TorchAttentionBackend().forward(batch.query, batch.key, batch.value, cache, batch.metadata,
                                           SCALE, sliding_window=window, logits_soft_cap=cap)


def paged_reference(batch: Batch, window: int | None, cap: float | None) -> torch.Tensor:
    return reference_paged_attention(batch.query.double(), batch.key.double(), batch.value.double(),
                                     batch.cache.double(), batch.metadata, SCALE, window, cap)


@pytest.fixture(params=["c_kernel", "torch_decode"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c_kernel" and not paged_decode_kernel.available():
        pytest.skip("no C compiler: kernel not built")
    if request.param == "torch_decode":
        monkeypatch.setattr(paged_decode_kernel, "available", lambda: False)
    return str(request.param)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_backend_matches_references(decode_path: str, window: int | None, cap: float | None, mix: str,
                                    heads: tuple[int, int]) -> None:
    batch = make_batch(MIXES[mix], 4, heads[0], heads[1], D, seed=len(mix) + heads[0])
    want = dense_batch(batch, SCALE, window, cap)
    assert_close(paged_reference(batch, window, cap), want, atol=1e-10, rtol=1e-10)
    got = run_backend(batch, window, cap)
    assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 3, 6, 13])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_blocks_outside_every_window_are_never_read(decode_path: str, window: int,
                                                    cap: float | None) -> None:
    """Blocks the cache manager freed point at the null block 0, filled (like the freed blocks)
    with NaN: the output is still the one computed from the real blocks."""
    reqs = [(37, 1), (29, 5), (0, 30), (50, 1), (45, 12), (8, 1)]
    batch = make_batch(reqs, 4, 6, 2, D, seed=window)
    freed, nulled = free_out_of_window(batch, window)
    assert nulled > 10
    got = run_backend(freed, window, cap)
    assert not got.isnan().any()
    assert_close(got.double(), dense_batch(batch, SCALE, window, cap), atol=2e-5, rtol=2e-5)
    assert_close(paged_reference(freed, window, cap), paged_reference(batch, window, cap))


@pytest.mark.parametrize("window, cap", [(5, None), (5, 2.0), (None, 2.0), (300, None)])
def test_long_prompts_are_attended_in_query_chunks(window: int | None, cap: float | None) -> None:
    """Over `_QUERY_CHUNK` new tokens, fresh and after cached context (chunk edges included)."""
    batch = make_batch([(0, 600), (70, 530)], 16, 4, 2, D, seed=3)
    got = run_backend(batch, window, cap)
    assert_close(got.double(), dense_batch(batch, SCALE, window, cap), atol=2e-5, rtol=2e-5)


def test_long_context_with_small_window_gathers_only_window_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk after 4000 cached tokens under a window of 8 gathers 2-4 blocks, not 250."""
    gathered: list[int] = []
    real = torch_backend._gather_blocks

    def spy(kv_cache: torch.Tensor, ids: torch.Tensor, kv: int) -> torch.Tensor:
        gathered.append(ids.numel())
        return real(kv_cache, ids, kv)

    monkeypatch.setattr(torch_backend, "_gather_blocks", spy)
    monkeypatch.setattr(paged_decode_kernel, "available", lambda: False)
    batch = make_batch([(4000, 5), (3000, 1)], 16, 2, 1, D, seed=9)
    got = run_backend(batch, 8, None)
    assert max(gathered) <= 2
    assert_close(got.double(), dense_batch(batch, SCALE, 8, None), atol=2e-5, rtol=2e-5)


def test_window_and_cap_off_keep_the_plain_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """No window (or one longer than the context) and no cap: SDPA's causal fresh prefill and the
    unmasked-by-window context path, as before."""
    calls: list[str] = []

    def spy(name: str) -> Callable[..., torch.Tensor]:
        real = getattr(torch_backend, name)

        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    for name in ("_self_causal", "_attend_with_context", "_attend_chunked", "_capped_attention"):
        monkeypatch.setattr(torch_backend, name, spy(name))
    batch = make_batch(MIXES["mixed"], 4, 4, 2, D)
    for window in (None, 1000, 0):
        calls.clear()
        run_backend(batch, window, None)
        assert sorted(set(calls)) == ["_attend_with_context", "_self_causal"]


def test_dense_reference_matches_transformers() -> None:
    """The dense reference's semantics are transformers': its sliding-window causal mask function
    and Gemma 2's eager attention (soft cap before the mask)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    seq, heads, kv_heads = 23, 4, 2
    q = torch.randn(seq, heads, D, dtype=torch.float64)
    k = torch.randn(seq, kv_heads, D, dtype=torch.float64)
    v = torch.randn(seq, kv_heads, D, dtype=torch.float64)
    q_idx: Any = torch.arange(seq)[:, None]  # the mask functions are typed for ints, work on tensors
    kv_idx: Any = torch.arange(seq)[None, :]
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    module.eval()
    for window in (None, 1, 4, 9, 40):
        fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
        allowed = torch.as_tensor(fn(0, 0, q_idx, kv_idx))  # [q, k] bool
        additive = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        for cap in (None, 1.5):
            hf, _ = eager_attention_forward(
                module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                additive[None, None], scaling=SCALE, softcap=cap)  # [1, seq, heads, d]
            # transformers runs the softmax in float32 even for float64 inputs
            assert_close(dense_attention(q, k, v, SCALE, window, cap), hf[0], atol=1e-6, rtol=1e-6)
            # and a query suffix (chunk after cached context) is the matching rows
            tail = dense_attention(q[-5:], k, v, SCALE, window, cap)
            assert_close(tail, hf[0, -5:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window, cap, message", [(-1, None, "sliding_window"), (None, -2.0, "soft_cap"),
                                                  (None, float("inf"), "soft_cap"), (2.5, None, "window")])
def test_bad_options_are_rejected(window: object, cap: float | None, message: str) -> None:
    batch = make_batch(MIXES["decode"], 4, 4, 4, D)
    with pytest.raises(ValueError, match=message):
        run_backend(batch, window, cap)  # type: ignore[arg-type]


def test_non_float32_runs_the_torch_paths() -> None:
    """float64 (no C kernel): decode with gathered window keys, chunks with the capped matmuls."""
    batch = make_batch(MIXES["mixed"], 4, 6, 2, D, dtype=torch.float64)
    for window, cap in ((3, None), (6, 1.5), (None, 1.5)):
        got = run_backend(batch, window, cap)
        assert_close(got, dense_batch(batch, SCALE, window, cap), atol=1e-10, rtol=1e-10)
