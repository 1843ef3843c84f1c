"""The Triton paged prefill/extend attention kernel equals its plain-PyTorch reference.

Runs in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA) and on the GPU when one is present. Tolerances against the float32 reference:
float32 atol 2e-5 / rtol 1e-5 (tl.dot in IEEE fp32); float16 atol 2e-3 / rtol 2e-3 and bfloat16
atol 2e-2 / rtol 2e-2 (one rounding of the output plus the probabilities rounded to the input
dtype before P @ V, as in flash attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.triton.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture
def device() -> str:
    return DEVICE


def make_case(context_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype, device: str, seed: int = 0,
              ) -> dict[str, Any]:
    """A varlen batch whose request i has context_lens[i] cached tokens and query_lens[i] new ones,
    its blocks scattered over the cache; spare table columns point at the null block 0."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 1
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).view(len(seq_lens), max_blocks)
    for b, n in enumerate(seq_lens):
        ids[b, -(-n // block_size):] = 0
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=g)
    return {
        "query": query.to(dtype).to(device),
        "kv_cache": kv_cache.to(dtype).to(device),
        "block_table": ids.to(torch.int32).to(device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": head_dim ** -0.5,
    }


def assert_matches_reference(case: dict[str, Any], got: torch.Tensor) -> None:
    want = paged_prefill_attention_reference(**case)
    atol, rtol = TOL[case["query"].dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


BATCHES = {  # name: (context lengths, new-token counts)
    "fresh_prefill": ([0, 0, 0], [1, 17, 40]),
    "chunked_prefill": ([16, 33], [20, 31]),
    "prefix_hit": ([70, 47], [5, 9]),
    "mixed_with_decode_and_empty_rows": ([0, 30, 5, 64, 12], [24, 1, 0, 1, 7]),
}
# (dtype, num_heads, num_kv_heads, head_dim, block_size, block_m, block_n): a covering set.
CONFIGS = [
    (torch.float32, 4, 4, 64, 16, 32, 16),
    (torch.float16, 8, 2, 64, 32, 32, 32),
    (torch.bfloat16, 8, 1, 128, 16, 64, 32),
    (torch.float32, 12, 4, 128, 32, 16, 16),  # GROUP 3 does not divide block_m
    (torch.bfloat16, 4, 1, 64, 16, None, None),  # default tile sizes
]


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-h{c[1]}kv{c[2]}d{c[3]}bs{c[4]}")
def test_kernel_matches_reference_for_varlen_batches(batch: str, config: tuple[Any, ...],
                                                     device: str) -> None:
    dtype, num_heads, num_kv_heads, head_dim, block_size, block_m, block_n = config
    context_lens, query_lens = BATCHES[batch]
    case = make_case(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    got = paged_prefill_attention(**case, max_query_len=max(query_lens), block_m=block_m, block_n=block_n)
    assert_matches_reference(case, got)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_context_lengths_crossing_block_boundaries(block_size: int, num_heads: int, num_kv_heads: int,
                                                   device: str) -> None:
    contexts = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    query_lens = [3, 1, block_size, 2, 9]
    case = make_case(contexts, query_lens, num_heads, num_kv_heads, 64, block_size, torch.float32, device,
                     seed=block_size)
    got = paged_prefill_attention(**case, max_query_len=block_size, block_m=32, block_n=16)
    assert_matches_reference(case, got)


def test_one_kv_head_for_many_query_heads_widens_the_tile(device: str) -> None:
    """GROUP 32 > block_m 16: the wrapper widens the tile to hold one token's heads."""
    case = make_case([9, 0], [4, 6], 32, 1, 64, 16, torch.float16, device)
    assert_matches_reference(case, paged_prefill_attention(**case, max_query_len=6, block_m=16))


def test_query_slice_of_fused_qkv_and_strided_out_are_used_in_place(device: str) -> None:
    case = make_case([5, 20], [7, 3], 8, 2, 64, 16, torch.float32, device)
    q = case["query"]
    qkv = torch.zeros(q.shape[0], 12, 64, dtype=q.dtype, device=device)  # q heads 0..7, k 8..9, v 10..11
    qkv[:, :8] = q
    out_wide = torch.full((q.shape[0], 2, 8, 64), 7.0, device=device)
    out = out_wide[:, 1]  # token stride 2 * 8 * 64
    got = paged_prefill_attention(**{**case, "query": qkv[:, :8]}, max_query_len=7, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_reference(case, out)
    assert bool((out_wide[:, 0] == 7.0).all())


def test_rows_past_the_batch_and_past_max_query_len_stay_unwritten(device: str) -> None:
    """CUDA-graph padding: rows after query_start_loc[-1] keep what `out` held."""
    case = make_case([3, 10], [5, 2], 4, 2, 64, 16, torch.float16, device)
    padded = torch.cat([case["query"], torch.randn(3, 4, 64, device=device).half()])
    out = torch.full_like(padded, 5.0)
    paged_prefill_attention(**{**case, "query": padded}, max_query_len=32, out=out)  # bound > q_len
    assert_matches_reference(case, out[:7])
    assert bool((out[7:] == 5.0).all())
    untouched = torch.full_like(padded, 5.0)
    assert paged_prefill_attention(**{**case, "query": padded}, max_query_len=0, out=untouched) is untouched
    assert bool((untouched == 5.0).all())


def test_reference_equals_dense_causal_sdpa_for_a_fresh_prefill() -> None:
    """The reference itself against an independent one: SDPA on unpaged data."""
    case = make_case([0], [37], 8, 2, 64, 16, torch.float32, "cpu")
    got = paged_prefill_attention_reference(**case)
    q = case["query"].transpose(0, 1)[None]  # [1, heads, L, d]
    ids = case["block_table"][0, :3].long()
    k, v = (case["kv_cache"][ids, i].reshape(-1, 2, 64)[:37].repeat_interleave(4, dim=1).transpose(0, 1)[None]
            for i in (0, 1))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case["scale"])
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-5, rtol=1e-5)


def _bad(**changes: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda a: {**a, **{k: f(a) for k, f in changes.items()}}


BAD_INPUTS = [
    (_bad(kv_cache=lambda a: a["kv_cache"][..., :32].contiguous()), "kv_cache"),  # head_dim mismatch
    (_bad(query=lambda a: a["query"][..., :48].contiguous()), "head_dim"),
    (_bad(query=lambda a: a["query"][0]), "query"),
    (_bad(query=lambda a: a["query"].double()), "query"),
    (_bad(query=lambda a: a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "query"),
    (_bad(kv_cache=lambda a: a["kv_cache"].half()), "kv_cache"),
    (_bad(kv_cache=lambda a: a["kv_cache"][:, :1]), "kv_cache"),
    (_bad(kv_cache=lambda a: a["kv_cache"][:, :, :, :3]), "num_kv_heads"),
    (_bad(kv_cache=lambda a: a["kv_cache"].transpose(2, 3).contiguous().transpose(2, 3)), "kv_cache"),
    (_bad(block_table=lambda a: a["block_table"].long()), "block_table"),
    (_bad(block_table=lambda a: a["block_table"][:1]), "block_table"),
    (_bad(block_table=lambda a: a["block_table"].t().contiguous().t()), "block_table"),
    (_bad(query_start_loc=lambda a: a["query_start_loc"][:-1]), "query_start_loc"),
    (_bad(query_start_loc=lambda a: a["query_start_loc"].long()), "query_start_loc"),
    (_bad(seq_lens=lambda a: a["seq_lens"].float()), "seq_lens"),
    (_bad(seq_lens=lambda a: a["seq_lens"][:, None]), "seq_lens"),
    (_bad(max_query_len=lambda a: torch.tensor(8)), "max_query_len"),
    (_bad(max_query_len=lambda a: -1), "max_query_len"),
    (_bad(scale=lambda a: float("nan")), "scale"),
    (_bad(out=lambda a: torch.empty_like(a["query"]).half()), "out"),
    (_bad(out=lambda a: torch.empty_like(a["query"])[:-1]), "out"),
    (_bad(out=lambda a: torch.empty_like(a["query"]).transpose(1, 2).contiguous().transpose(1, 2)), "out"),
    (_bad(block_n=lambda a: 24), "block_n"),
    (_bad(block_m=lambda a: 8), "block_m"),
    (_bad(seq_lens=lambda a: a["seq_lens"].to("meta")), "seq_lens"),  # device mismatch
    (_bad(out=lambda a: torch.empty_like(a["query"], device="meta")), "out"),
]


@pytest.mark.parametrize("mutate, name", BAD_INPUTS)
def test_bad_inputs_are_rejected_before_the_launch(mutate: Callable[[dict[str, Any]], dict[str, Any]],
                                                    name: str, device: str) -> None:
    case = make_case([5, 20], [7, 3], 8, 4, 64, 16, torch.float32, device)
    args = mutate({**case, "max_query_len": 7, "out": None})
    with pytest.raises(ValueError, match=name):
        paged_prefill_attention(**args)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([5], [7], 4, 4, 64, 16, torch.float32, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        paged_prefill_attention(**case, max_query_len=7)


@pytest.mark.gpu
def test_block_ids_past_int32_element_offsets_are_read_correctly() -> None:
    """A cache of more than 2**31 elements: the request's blocks sit at its top end."""
    block_size, num_kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (2 * block_size * num_kv_heads * head_dim) + 64
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                           device="cuda")
    case = make_case([100], [60], 32, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda")
    small = case["kv_cache"]
    top = num_blocks - small.shape[0]
    kv_cache[top:] = small
    table = torch.where(case["block_table"] > 0, case["block_table"] + top, 0).to(torch.int32)
    got = paged_prefill_attention(**{**case, "kv_cache": kv_cache, "block_table": table}, max_query_len=60)
    assert_matches_reference(case, got)


@pytest.mark.gpu
def test_fresh_prefill_equals_dense_sdpa_at_a_real_model_shape() -> None:
    """16 x 1024-token prompts, Llama-3.2-1B attention shape (32 heads, 8 kv heads, d 64), bf16:
    the paged kernel gives what SDPA gives on dense copies of the same data. Its speed against
    SDPA is a benchmark row (benchmarks/bench_gpu.py, target 0.8x), not a timed unit test."""
    reqs, length, heads, kv_heads, d, bs = 16, 1024, 32, 8, 64, 16
    case = make_case([0] * reqs, [length] * reqs, heads, kv_heads, d, bs, torch.bfloat16, "cuda")
    # Dense copies of the same data for SDPA, kv heads repeated: [reqs, heads, L, d].
    q = case["query"].view(reqs, length, heads, d).transpose(1, 2).contiguous()
    ids = case["block_table"][:, : length // bs].long()
    k, v = (case["kv_cache"][ids, i].reshape(reqs, length, kv_heads, d)
            .repeat_interleave(heads // kv_heads, 2).transpose(1, 2).contiguous() for i in (0, 1))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = paged_prefill_attention(**case, max_query_len=length)
    torch.testing.assert_close(got.view(reqs, length, heads, d), want.transpose(1, 2),
                               atol=2e-2, rtol=2e-2)
