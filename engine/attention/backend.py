"""Attention-backend interface: where the PyTorch (CPU) and Triton (GPU) backends plug in.

KV cache layout, one tensor per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, 1 is V). Token at position `p` of a request lives in block
`block_table[p // block_size]` at offset `p % block_size`; its slot is
`block_id * block_size + offset`. Block 0 is the null block: it pads block tables and is never
written.

One forward step is a varlen batch: request `i` brings `query_lens[i]` new tokens (rows
`query_start_loc[i]:query_start_loc[i+1]` of the flattened batch), and after this step has
`seq_lens[i]` tokens of context, so its new tokens sit at positions
`seq_lens[i] - query_lens[i] ... seq_lens[i] - 1` and attend causally to everything before them
(cached context from earlier steps or from the prefix cache, plus the new tokens themselves).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the model runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write this token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of the above (lists), so CPU backends avoid device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(abc.ABC):
    """Writes a layer's new K/V into its paged cache and computes attention for the batch."""

    name: str = "abstract"

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store key/value at `metadata.slot_mapping`, then attend; returns
        `[num_tokens, num_heads, head_dim]`. All new K/V of the batch is written before any
        attention reads the cache (so a request may read blocks another request of the same
        step writes, as prefix-cache hits within one step do)."""
