"""The causal LM every architecture here is built as, over a paged KV cache.

The model takes the flattened tokens of one varlen batch (`input_ids`, `positions`), one KV
cache tensor per layer and the step's `AttentionMetadata`; it returns the final-normed hidden
states of every token. The runner picks the rows it needs and calls `compute_logits`.
Layers with a sliding window attend to the last `window` positions only (the attention
backends mask by window); Gemma 3's local and global layers each get their own RoPE.
Under tensor parallelism (`tp`, engine/parallel/) each rank builds the model of its shard: its
heads, its MLP and expert slices, its vocabulary rows; `load_weights` takes each checkpoint
tensor's slice of this rank and `compute_logits` gathers the vocab shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.model.arch import ArchOptions
from engine.model.layers import DecoderLayer, RMSNorm
from engine.model.linear import linear
from engine.model.mlp import param
from engine.model.models import options_for
from engine.model.rope import RotaryEmbedding
from engine.model.weights import map_name
from engine.parallel.group import TensorParallel
from engine.parallel.shard import Shard

LayerHook = Callable[[int], None]


class CausalLM(nn.Module):
    """Decoder-only transformer: embedding, `num_layers` decoder layers, final norm, LM head."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, opts: ArchOptions | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = hf_config
        full = opts or options_for(hf_config)
        self.full_vocab_size = full.vocab_size
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.shard = None if self.tp is None else Shard(full, self.tp.rank, self.tp.size)
        self.opts = opts = full if self.shard is None else self.shard.options()
        self.dtype = dtype
        self.embed_tokens = param(opts.vocab_size, opts.hidden_size, dtype=dtype)
        max_pos = int(hf_config.max_position_embeddings)
        ropes = {t: RotaryEmbedding(hf_config, opts.head_dim, max_pos, t)
                 for t in dict.fromkeys(opts.rope_layer_types)}
        self.ropes = nn.ModuleList(ropes.values())
        # LongRoPE picks a frequency set per token from the step's lengths (one model-wide rope)
        self._longrope: RotaryEmbedding | None = next(
            (r for r in ropes.values() if r.long_after is not None), None)
        self.layers = nn.ModuleList(
            DecoderLayer(opts, i, ropes[opts.rope_layer_types[i]], attn_backend, dtype, self.tp)
            for i in range(opts.num_layers)
        )
        self.norm = RMSNorm(opts.hidden_size, opts.norm_eps, dtype, opts.gemma_norms)
        self.tie_word_embeddings = opts.tie_word_embeddings
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else param(
            opts.vocab_size, opts.hidden_size, dtype=dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.opts.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.opts.head_dim

    @property
    def vocab_size(self) -> int:
        """The whole vocabulary (under tensor parallelism a rank holds a shard of it)."""
        return self.full_vocab_size

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: the layer attends to the whole context)."""
        return self.opts.windows

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        before_layer: LayerHook | None = None,
        after_layer: LayerHook | None = None,
        layer_metadata: Sequence[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Runs all layers (writing each layer's new K/V into its cache); returns the
        final-normed hidden states `[num_tokens, hidden]`. `before_layer(i)` / `after_layer(i)`
        are called around layer `i` (e.g. a KV connector waiting for a layer's load, or
        saving a layer's KV as soon as it is written). `layer_metadata[i]`, where given, is layer
        `i`'s (a hybrid model's KV cache groups have their own block tables); else `metadata`."""
        x = self._embed(input_ids)  # [num_tokens, hidden]
        if self.opts.embed_scale is not None:
            x = x * torch.tensor(self.opts.embed_scale, dtype=x.dtype)
        long_tokens = None if self._longrope is None else self._longrope.long_tokens(
            positions, metadata.query_lens_cpu, metadata.seq_lens_cpu, metadata.is_pure_decode)
        residual: torch.Tensor | None = None  # the stream, with `x` still to be added to it
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x, residual = layer(positions, x, kv_caches[i],
                                metadata if layer_metadata is None else layer_metadata[i],
                                long_tokens, residual)
            if after_layer is not None:
                after_layer(i)
        if residual is None:
            return self.norm(x)
        return self.norm.add_and_norm(residual, x)[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        # vocab-parallel: this rank's rows; a token of another rank's embeds to zero here
        first = self.tp.rank * self.opts.vocab_size
        local = input_ids - first
        outside = (local < 0) | (local >= self.opts.vocab_size)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> float32 logits `[n, vocab_size]` (soft-capped where the model is).
        Under tensor parallelism every rank calls it (it gathers the ranks' vocab shards)."""
        logits = linear(hidden, self.lm_head).float()
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.full_vocab_size)
        cap = self.opts.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors (`model.layers.0.self_attn.q_proj.weight`, ...)
        into the (fused) parameters. Raises ValueError for unknown names, wrong shapes, or
        parameters the checkpoint leaves (partly) unset."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: dict[str, int] = {}  # parameter name -> elements set so far
        for hf_name, tensor in weights:
            target = map_name(hf_name, self.opts)
            if target is None:
                continue
            name, index = target
            if self.shard is not None:
                tensor = self.shard.slice(hf_name, tensor)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            dst = params[name].data if index is None else params[name].data[index]
            if dst.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor.to(self.dtype))
            loaded[name] = loaded.get(name, 0) + dst.numel()
        missing = [
            name for name, p in params.items()
            if loaded.get(name, 0) < p.numel() and not (name == "lm_head" and self.tie_word_embeddings)
        ]
        if missing:
            raise ValueError(f"checkpoint does not set parameters: {missing}")
