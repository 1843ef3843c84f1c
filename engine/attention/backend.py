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

Per-layer options of `AttentionBackend.forward` (both `None` = off), with the semantics of
Hugging Face transformers (`masking_utils.sliding_window_causal_mask_function`, Gemma 2's
`eager_attention_forward`):
- `sliding_window` (int >= 1): a query at absolute position `q` attends to the keys at positions
  `k` with `q - sliding_window < k <= q`, i.e. the last `sliding_window` keys including its own
  (Mistral, Qwen2/3, Phi-3, Gemma 2/3 local layers). A window at least as long as the context
  changes nothing.
- `logits_soft_cap` (float > 0): the scaled scores become `cap * tanh(q.k * scale / cap)`,
  before the mask and the softmax (Gemma 2).
A step never reads a cache block that lies wholly before the window of every one of its
queries: for a request, the blocks holding positions below
`seq_len - query_len - sliding_window + 1`. The KV cache manager may free such blocks and put
the null block 0 in their block-table entries.
"""

from __future__ import annotations

import abc
import math
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
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Store key/value at `metadata.slot_mapping`, then attend; returns
        `[num_tokens, num_heads, head_dim]`. All new K/V of the batch is written before any
        attention reads the cache (so a request may read blocks another request of the same
        step writes, as prefix-cache hits within one step do). `sliding_window` and
        `logits_soft_cap`: see the module docstring (`None` = off)."""


def check_attention_options(sliding_window: int | None,
                            logits_soft_cap: float | None) -> tuple[int | None, float | None]:
    """Validates the per-layer options and normalizes "off" to None (0 counts as off too, as
    in kernel arguments). Raises ValueError for a negative window or a non-finite or negative cap."""
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int) or sliding_window < 0):
        raise ValueError(f"sliding_window must be an int >= 1 (or None), got {sliding_window!r}")
    if logits_soft_cap is not None and not (0.0 <= float(logits_soft_cap) < math.inf):
        raise ValueError(f"logits_soft_cap must be a finite float > 0 (or None), got {logits_soft_cap!r}")
    return sliding_window or None, (float(logits_soft_cap) if logits_soft_cap else None)
