"""What each tensor-parallel rank holds, and the slice of each checkpoint tensor that fills it
(Megatron's split, as vLLM's parallel layers make it):

- attention, by KV head groups (a KV head and the H/KV query heads that read it stay together):
  with at least as many KV heads as ranks, rank r holds a contiguous run of them, as even as it
  goes (`kv_head_range`: SmolLM2's 3 KV heads on 2 ranks are 2 + 1, so 6 + 3 query heads, where
  vLLM refuses the size), and their query heads. With fewer KV heads than ranks, each KV head is
  replicated on tp / KV ranks (rank r holds KV head r // (tp / KV)) and the query heads split
  evenly. q/k/v are column-parallel, the output projection row-parallel (its partial sums are
  added over the ranks, then its bias once);
- the dense MLP: gate/up column-parallel, down row-parallel, over intermediate/tp columns;
- mixture of experts: tensor parallel inside every expert (each rank holds every expert's
  intermediate/tp slice, and the shared expert's), the router replicated; the expert outputs
  are partial sums added over the ranks once, with the shared expert's;
- embedding and LM head: vocab-parallel, ceil(V/tp) rows a rank (the last padded with zeros); a
  token outside a rank's rows embeds to zero there and the sum over ranks is its row; the
  logits are the ranks' shards side by side;
- norms (q/k norms included), RoPE and the MoE router: replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from engine.model.arch import ArchOptions


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"tensor_parallel_size: {what}")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, for a model of options `full`."""

    full: ArchOptions
    rank: int
    size: int

    def __post_init__(self) -> None:
        o, tp = self.full, self.size
        _check(o.num_heads % o.num_kv_heads == 0,
               f"the model's {o.num_heads} attention heads are not groups of its {o.num_kv_heads} KV heads")
        if o.num_kv_heads < tp:
            _check(tp % o.num_kv_heads == 0 and o.num_heads % tp == 0,
                   f"{tp} ranks for the model's {o.num_kv_heads} KV heads: with fewer KV heads than "
                   f"ranks, the ranks must be a multiple of them and divide the {o.num_heads} "
                   f"attention heads")
        _check(o.intermediate_size % tp == 0,
               f"{tp} does not divide the MLP's intermediate size {o.intermediate_size}")
        if o.moe is not None:
            _check(o.moe.intermediate_size % tp == 0,
                   f"{tp} does not divide the experts' intermediate size {o.moe.intermediate_size}")
            _check(o.moe.shared_intermediate_size % tp == 0,
                   f"{tp} does not divide the shared expert's size {o.moe.shared_intermediate_size}")

    @property
    def kv_heads(self) -> int:
        return kv_head_range(self.full.num_kv_heads, self.size, self.rank)[1]

    @property
    def first_kv_head(self) -> int:
        return kv_head_range(self.full.num_kv_heads, self.size, self.rank)[0]

    @property
    def heads(self) -> int:
        o = self.full
        if o.num_kv_heads < self.size:
            return o.num_heads // self.size
        return self.kv_heads * (o.num_heads // o.num_kv_heads)  # its KV heads' query groups

    @property
    def first_head(self) -> int:
        o = self.full
        if o.num_kv_heads < self.size:
            return self.rank * self.heads
        return self.first_kv_head * (o.num_heads // o.num_kv_heads)

    @property
    def vocab_rows(self) -> int:
        return -(-self.full.vocab_size // self.size)

    def options(self) -> ArchOptions:
        """The options this rank's model is built from (its heads, slices and vocab rows)."""
        o, tp = self.full, self.size
        moe = o.moe if o.moe is None else replace(
            o.moe, intermediate_size=o.moe.intermediate_size // tp,
            shared_intermediate_size=o.moe.shared_intermediate_size // tp)
        return replace(o, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=o.intermediate_size // tp, vocab_size=self.vocab_rows, moe=moe)

    # --- checkpoint tensors -------------------------------------------------------------------
    def slice(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `hf_name` (the whole tensor where replicated)."""
        name = hf_name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return self._vocab(tensor)
        match = _LAYER_TENSOR.match(name)
        if match is None:
            return tensor
        module, kind = match.group(1), match.group(2)
        o = self.full
        d, q = o.head_dim, o.num_heads * o.head_dim
        kv = o.num_kv_heads * d
        heads = (self.first_head * d, self.heads * d)
        kv_rows = (self.first_kv_head * d, self.kv_heads * d)
        inter = o.intermediate_size // self.size
        moe_inter = o.moe.intermediate_size // self.size if o.moe else 0
        shared = o.moe.shared_intermediate_size // self.size if o.moe else 0
        r = self.rank
        if module == "self_attn.q_proj":
            return _rows(tensor, *heads)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return _rows(tensor, *kv_rows)
        if module == "self_attn.qkv_proj":  # Phi-3: q | k | v
            return torch.cat([_rows(tensor, heads[0], heads[1]), _rows(tensor, q + kv_rows[0], kv_rows[1]),
                              _rows(tensor, q + kv + kv_rows[0], kv_rows[1])])
        if module == "self_attn.o_proj":
            return _cols(tensor, *heads) if kind == "weight" else tensor
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return _rows(tensor, r * inter, inter)
        if module == "mlp.gate_up_proj":  # Phi-3: gate | up
            full = o.intermediate_size
            return torch.cat([_rows(tensor, r * inter, inter), _rows(tensor, full + r * inter, inter)])
        if module == "mlp.down_proj":
            return _cols(tensor, r * inter, inter) if kind == "weight" else tensor
        if module in ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"):
            return _rows(tensor, r * shared, shared)
        if module == "mlp.shared_expert.down_proj":
            return _cols(tensor, r * shared, shared)
        expert = _EXPERT.match(module)
        if expert is not None:
            if expert.group(1) in ("gate_proj", "up_proj", "w1", "w3"):
                return _rows(tensor, r * moe_inter, moe_inter)
            return _cols(tensor, r * moe_inter, moe_inter)  # down_proj / w2
        if module.endswith("experts") and kind == "gate_up_proj":  # transformers 5: [E, 2I, H]
            full = tensor.shape[1] // 2
            return torch.cat([tensor[:, r * moe_inter:(r + 1) * moe_inter],
                              tensor[:, full + r * moe_inter:full + (r + 1) * moe_inter]], dim=1)
        if module.endswith("experts") and kind == "down_proj":  # [E, H, I]
            return tensor[:, :, r * moe_inter:(r + 1) * moe_inter]
        return tensor

    def _vocab(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = self.vocab_rows
        part = tensor[self.rank * rows:(self.rank + 1) * rows]
        if part.shape[0] == rows:
            return part
        pad = torch.zeros(rows - part.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
        return torch.cat([part, pad])


def kv_head_range(kv_heads: int, world: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) of `rank` of `world`: contiguous runs as even as they go (the first
    `kv_heads % world` ranks one more), or with fewer heads than ranks, head rank // (world /
    kv_heads) (replicated)."""
    if world <= kv_heads:
        base, extra = divmod(kv_heads, world)
        return rank * base + min(rank, extra), base + (rank < extra)
    return rank // (world // kv_heads), 1


_LAYER_TENSOR = re.compile(r"^layers\.\d+\.(.+)\.(\w+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)$")


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[start:start + count]


def _cols(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[:, start:start + count]
