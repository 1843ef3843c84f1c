"""Triton attention backend (CUDA): the new K/V of the step are written into the paged cache by
`reshape_and_cache`; pure decode steps then run the split-K paged decode kernel, every other
step (prefill chunks, prefix-cache hits, mixed prefill + decode) the varlen prefill kernel,
which reads cached context and new tokens alike from the paged cache.

No host syncs: what sizes a launch comes from the metadata's host ints (`max_query_len`,
`max_seq_len`), so decode steps can be captured as CUDA graphs (where `max_seq_len` is the
model's limit and rows past the batch have `seq_len` 0 and slot -1).

Sliding window and logit soft cap (per layer, see `engine.attention.backend`) go to both kernels,
which take them as compile-time switches: a layer without them runs the same code as before,
and no kernel reads a block wholly before the window of every query of the step.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, check_attention_options
from kernels.triton.paged_decode import paged_decode_attention
from kernels.triton.prefill_attention import paged_prefill_attention
from kernels.triton.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        window, cap = check_attention_options(sliding_window, logits_soft_cap)
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        if metadata.is_pure_decode:
            return paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                          scale, max_seq_len=metadata.max_seq_len,
                                          sliding_window=window, logits_soft_cap=cap)
        return paged_prefill_attention(query, kv_cache, metadata.block_table,
                                       metadata.query_start_loc, metadata.seq_lens, scale,
                                       max_query_len=metadata.max_query_len,
                                       sliding_window=window, logits_soft_cap=cap)
