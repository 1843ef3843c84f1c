"""Prepacked (oneDNN-blocked) weights for the CPU's bfloat16 GEMMs.

`F.linear` on bf16 CPU tensors goes through oneDNN, which re-lays the weight out into its
blocked VNNI format on every call. `prepack_linear_weights(model)` does that once after loading:
each weight used through `engine.model.linear.linear` (fused QKV, output projection, gate/up,
down, and the LM head) is replaced by its packed form, an opaque `torch._mkldnn` tensor that
`linear()` hands to `torch.ops.mkldnn._linear_pointwise`. The products and their order inside
oneDNN's kernel are the same, so outputs are bit-identical to `F.linear` (tested); the time is
not: 1.1-1.3x faster at 64 rows, 1.35-1.65x at 16 rows and 1.2-1.5x at 1 (decode steps),
1.03-1.06x at 256 rows and more (prefill), default model's shapes, 2 threads, weights from RAM
(`python benchmarks/bench_linear.py --threads 2 --dtype bfloat16 --rows 1,16,64,256`).
vLLM's CPU backend prepacks its oneDNN GEMMs the same way.

The packed weight replaces the parameter (same bytes, another layout); a tied LM head keeps the
embedding as it is and gets a packed copy of its own (the embedding lookup needs plain rows).
Only bfloat16 on the CPU is packed, and only where oneDNN supports bf16 on this CPU: float32
keeps `F.linear` (MKL), the reference path the exactness tests hold to.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Attributes of the model's modules that only `linear()` reads.
LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head")


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device get packed."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepack_linear_weights(model: nn.Module) -> int:
    """Packs every bf16 CPU weight in LINEAR_WEIGHTS of `model`'s modules; returns how many."""
    packed = 0
    for module in model.modules():
        for name in LINEAR_WEIGHTS:
            weight = getattr(module, name, None)
            if not isinstance(weight, torch.Tensor) or weight.is_mkldnn or weight.dim() != 2:
                continue
            if not can_prepack(weight.dtype, weight.device):
                continue
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
            if name in module._parameters:
                del module._parameters[name]
            setattr(module, name, blocked)
            packed += 1
    if packed:
        logger.info("prepacked %d bf16 linear weights for oneDNN", packed)
    return packed
