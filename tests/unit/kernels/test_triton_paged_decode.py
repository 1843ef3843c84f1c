"""The Triton paged-decode kernel (flash-decoding) equals its plain-PyTorch reference.

Runs on CUDA when present, else on CPU tensors in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). A small partition_size makes short contexts cross partitions cheaply.
Tolerances (output vs the float32 reference cast back): float32 1e-5; float16 2e-3; bfloat16
1.6e-2, one bf16 ulp near 1 (the kernel feeds P to the PV dot in bf16, and the interpreter's
fp32->bf16 cast truncates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.triton.paged_decode import paged_decode_attention, paged_decode_attention_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0) -> Case:
    """query, kv_cache, block_table, seq_lens with scattered block ids; padding -> null block 0."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # a spare column of padding
    num_blocks = len(lens) * max_blocks + 1
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(lens) * max_blocks]
    block_table = ids.view(len(lens), max_blocks).to(torch.int32)
    for b, n in enumerate(lens):
        block_table[b, -(-n // block_size):] = 0
    query = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return (query.to(device, dtype), kv_cache.to(device, dtype), block_table.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def check(case: Case, scale: float = 0.125, partition_size: int = 32, max_seq_len: int | None = None,
          tile_tokens: int = 64) -> None:
    q, cache, table, seq_lens = case
    if max_seq_len is None:
        max_seq_len = table.shape[1] * cache.shape[2]
    got = paged_decode_attention(q, cache, table, seq_lens, scale, max_seq_len,
                                 partition_size=partition_size, tile_tokens=tile_tokens)
    want = paged_decode_attention_reference(q, cache, table, seq_lens, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOL[q.dtype], rtol=TOL[q.dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_matches_reference_across_block_and_partition_boundaries(
        device: str, block_size: int, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """GQA ratios 1, 4, 8; lengths around a block edge and one crossing several partitions."""
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 37]
    check(make_case(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partition_size", [16, 512])
def test_matches_reference_per_dtype_split_and_single_pass(device: str, dtype: torch.dtype,
                                                           partition_size: int) -> None:
    """partition 16: up to 19 partitions merged by the combine kernel (more than one chunk of
    16); 512: one pass writes out."""
    check(make_case([3, 16, 17, 300], 8, 2, 64, 16, dtype, device), partition_size=partition_size)


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_matches_reference_for_batches(device: str, batch: int) -> None:
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 40, (batch,), generator=g).tolist()
    check(make_case(lens, 4, 1, 64, 16, torch.bfloat16, device, seed=batch), partition_size=32)


def test_zero_length_requests_give_zeros(device: str) -> None:
    q, cache, table, _ = make_case([20, 20, 20], 4, 2, 64, 16, torch.float16, device)
    seq_lens = torch.tensor([0, 20, 0], dtype=torch.int32, device=device)
    for partition_size in (16, 512):
        out = paged_decode_attention(q, cache, table, seq_lens, 0.1, 32, partition_size=partition_size)
        assert not out.isnan().any()
        assert out[0].eq(0).all() and out[2].eq(0).all()
        want = paged_decode_attention_reference(q, cache, table, seq_lens, 0.1)
        torch.testing.assert_close(out, want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


def test_max_seq_len_beyond_every_request_leaves_extra_partitions_empty(device: str) -> None:
    """Under CUDA graphs the grid is sized by max_model_len, far above the actual lengths."""
    q, cache, _, seq_lens = make_case([5, 33], 8, 2, 64, 16, torch.float32, device)
    table = torch.zeros(2, 16, dtype=torch.int32, device=device)  # room for 256 tokens
    table[0, :1] = 3
    table[1, :3] = torch.tensor([7, 1, 4], dtype=torch.int32)
    check((q, cache, table, seq_lens), partition_size=16, max_seq_len=256)


def test_other_head_dims_and_block_sizes_are_padded(device: str) -> None:
    """head_dim 80 pads to 128; block sizes 8 and 64 (tiles hold several / part of a block)."""
    check(make_case([7, 50], 4, 2, 80, 16, torch.float16, device), tile_tokens=16)
    check(make_case([7, 50], 4, 2, 64, 8, torch.float16, device))
    check(make_case([7, 130], 4, 2, 64, 64, torch.float16, device), partition_size=128)


def test_strided_query_and_out_are_used_in_place(device: str) -> None:
    """query rows sliced from a fused qkv buffer; `out` a strided view, written and returned."""
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 16, torch.float32, device)
    qkv = torch.zeros(2, 3, 4, 64, device=device)
    qkv[:, 0] = q
    out_buf = torch.full((2, 2, 4, 64), 7.0, device=device)
    out = paged_decode_attention(qkv[:, 0], cache, table, seq_lens, 0.1, 48, out_buf[:, 1],
                                 partition_size=16)
    assert out.data_ptr() == out_buf[:, 1].data_ptr()
    want = paged_decode_attention_reference(q, cache, table, seq_lens, 0.1)
    torch.testing.assert_close(out_buf[:, 1], want)
    assert out_buf[:, 0].eq(7.0).all()


def test_indexing_past_int32_elements_of_the_cache(device: str) -> None:
    """Blocks at the end of a cache of more than 2**31 elements (offsets need int64). On CPU only
    the touched pages of the 4 GiB tensor are committed."""
    block_size, head_dim = 16, 64
    num_blocks = 2**31 // (2 * block_size * head_dim) + 8
    cache = torch.empty(num_blocks, 2, block_size, 1, head_dim, dtype=torch.float16, device=device)
    ids = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 3]], dtype=torch.int32, device=device)
    cache[ids[0].long()] = torch.randn(3, 2, block_size, 1, head_dim, device=device).half()
    q = torch.randn(1, 4, head_dim, device=device).half()
    check((q, cache, ids, torch.tensor([40], dtype=torch.int32, device=device)), partition_size=16)


def _args(device: str) -> dict[str, Any]:
    q, cache, table, seq_lens = make_case([5, 40], 4, 2, 64, 16, torch.float32, device)
    return {"query": q, "kv_cache": cache, "block_table": table, "seq_lens": seq_lens, "scale": 0.1,
            "max_seq_len": 48}


Mutation = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.mark.parametrize("mutate, message", [
    (lambda a: {**a, "query": a["query"].double()}, "query must be"),
    (lambda a: {**a, "query": a["query"].half()}, "kv_cache must be float16"),
    (lambda a: {**a, "block_table": a["block_table"].long()}, "block_table must be int32"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].long()}, "seq_lens must be int32"),
    (lambda a: {**a, "query": a["query"][:, :, :32]}, "kv_cache must have shape"),
    (lambda a: {**a, "query": a["query"][:, :3]}, "num_heads 3"),
    (lambda a: {**a, "query": a["query"][0]}, "query must be"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][:, :1]}, "kv_cache must be"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must have shape"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, "block_table must have shape"),
    (lambda a: {**a, "query": a["query"].transpose(1, 2).contiguous().transpose(1, 2)}, "query must be con"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)},
     "kv_cache must be contiguous"),
    (lambda a: {**a, "block_table": a["block_table"].t().contiguous().t()}, "block_table must be contig"),
    (lambda a: {**a, "out": torch.empty_like(a["query"]).half()}, "out must be float32"),
    (lambda a: {**a, "out": torch.empty_like(a["query"])[:1]}, "out must have shape"),
    (lambda a: {**a, "max_seq_len": 10_000}, "max_seq_len 10000 is more than block_table covers"),
    (lambda a: {**a, "partition_size": 24}, "partition_size must be a power of two"),
    (lambda a: {**a, "tile_tokens": 8}, "tile_tokens must be a power of two"),
    (lambda a: {**a, "max_seq_len": -1}, "max_seq_len must be >= 0"),
])
def test_bad_inputs_are_rejected_before_launch(device: str, mutate: Mutation, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**mutate(_args(device)))


def test_inputs_on_another_device_are_rejected(device: str) -> None:
    args = _args(device)
    other = "cpu" if device == "cuda" else "meta"
    with pytest.raises(ValueError, match="seq_lens must be on"):
        paged_decode_attention(**{**args, "seq_lens": args["seq_lens"].to(other)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checked only on CPU: a host read would sync")
def test_seq_len_over_max_seq_len_is_rejected_on_cpu() -> None:
    with pytest.raises(ValueError, match="over max_seq_len"):
        paged_decode_attention(**{**_args("cpu"), "max_seq_len": 32})


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="query must be a CUDA tensor"):
        paged_decode_attention(**_args("cpu"))
