"""The worst-case step the CUDA KV sizing profiles: a forward over `max_num_batched_tokens`
tokens (prefill-shaped, split into requests of at most `max_model_len`) with a throwaway KV
cache just big enough for it, then logits and softmax for `max_num_seqs` rows (the sampler's
largest tensors). The throwaway cache is freed before the peak is read back, and its bytes are
left out of the measured peak by the caller's subtraction (see `run_profile_step`)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata
from engine.config import EngineConfig
from engine.runner import CausalLM


@torch.inference_mode()
def run_profile_step(model: CausalLM, config: EngineConfig, dtype: torch.dtype,
                     device: torch.device) -> int:
    """Runs the step; returns the bytes of the throwaway cache (to subtract from the peak)."""
    total = config.max_num_batched_tokens
    per_req = min(total, config.model_len)
    lens = [per_req] * (total // per_req) + ([total % per_req] if total % per_req else [])
    bs = config.block_size
    blocks_per_req = -(-per_req // bs)
    num_blocks = len(lens) * blocks_per_req + 1
    caches = [torch.zeros(num_blocks, 2, bs, model.num_kv_heads, model.head_dim, dtype=dtype,
                          device=device) for _ in range(model.num_layers)]
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    table = torch.arange(1, num_blocks, dtype=torch.int32).view(len(lens), blocks_per_req)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device), query_start_loc=cu.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=table.to(device), max_query_len=max(lens), max_seq_len=max(lens),
        query_lens_cpu=lens, seq_lens_cpu=lens)
    ids = torch.zeros(total, dtype=torch.int64, device=device)
    hidden = model(ids, positions.to(device), caches, metadata)
    rows = min(config.max_num_seqs, total)
    logits = model.compute_logits(hidden[:rows])
    torch.softmax(logits, dim=-1).sort(dim=-1)
    del caches, hidden, logits
    return cache_bytes
