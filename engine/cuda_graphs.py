"""Decode steps as captured CUDA graphs (vLLM's CUDAGraphRunner, in small).

At start-up the model's forward for a pure decode batch is captured once per batch size in
`capture_sizes(max_num_seqs)` (1, 2, 4, then multiples of 8), over static input buffers and
one shared memory pool. A decode step of `n` requests replays the smallest graph of size >= n:
its inputs are copied into the static buffers, rows `n..size` are padding (slot -1, so nothing
is written, and seq_len 0, so nothing is read) and the first `n` rows of the output are used.
Graphs are captured with `max_seq_len = max_model_len`, which fixes the decode kernel's grid.
A hybrid model's KV cache groups (engine/core/kv_layout.py) each have their own static slots
and block table; each layer reads its group's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from engine.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

ModelFn = Callable[..., torch.Tensor]  # (input_ids, positions, kv_caches, metadata, layer_metadata=)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards, one per batch size, sharing static inputs and a memory pool."""

    def __init__(self, model: ModelFn, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 layer_group: Sequence[int] | None = None) -> None:
        self.model = model
        self.layer_group = list(layer_group) if layer_group is not None else None
        num_groups = max(self.layer_group) + 1 if self.layer_group else 1
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        size = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mappings = [torch.full((size,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_groups)]
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, size: int) -> tuple[AttentionMetadata, list[AttentionMetadata] | None]:
        """The static metadata of a graph of `size` rows: the first group's, and per layer its
        group's (None when there is one group)."""
        first = AttentionMetadata(
            slot_mapping=self.slot_mappings[0][:size],
            query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_tables[0][:size],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size)
        if len(self.block_tables) == 1 or self.layer_group is None:
            return first, None
        groups = [replace(first, slot_mapping=slots[:size], block_table=table[:size])
                  for slots, table in zip(self.slot_mappings, self.block_tables, strict=True)]
        return first, [groups[g] for g in self.layer_group]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first (later graphs reuse the pool's memory). Inputs
        are padding during capture: slot -1 and seq_len 0, so the cache is left untouched."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            metadata, layer_metadata = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
            kwargs = {} if layer_metadata is None else {"layer_metadata": layer_metadata}
            self.model(*args, **kwargs)  # warm-up: compiles kernels, settles cuBLAS workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args, **kwargs)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_reqs: int) -> bool:
        return bool(self.graphs) and num_reqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata,
            layer_metadata: list[AttentionMetadata] | None = None) -> torch.Tensor:
        """Replays the graph for a pure decode batch of `n` requests; returns `[n, hidden]`.
        `layer_metadata`: per layer, its KV cache group's (hybrid models)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:size].zero_()
        groups = [metadata]
        if layer_metadata is not None and self.layer_group is not None:
            groups = [metadata] * len(self.block_tables)
            for layer, g in enumerate(self.layer_group):
                groups[g] = layer_metadata[layer]
        for g, meta in enumerate(groups):
            width = meta.block_table.shape[1]
            self.slot_mappings[g][:n].copy_(meta.slot_mapping)
            self.slot_mappings[g][n:size].fill_(-1)
            self.block_tables[g][:n, :width].copy_(meta.block_table)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
