"""Prepacked (oneDNN-blocked) weights for the CPU's GEMMs, bfloat16 and float32.

`F.linear` on bf16 CPU tensors goes through oneDNN, which re-lays the weight out into its
blocked VNNI format on every call; on float32 ones it calls MKL's sgemm, which packs its
operands on every call too. `prepack_linear_weights(model)` does that once after loading:
each weight used through `engine.model.linear.linear` (fused QKV, output projection, gate/up,
down, and the LM head) is replaced by its packed form, an opaque `torch._mkldnn` tensor that
`linear()` hands to `torch.ops.mkldnn._linear_pointwise`. The products and their order inside
oneDNN's kernel are the same, so outputs are bit-identical to `F.linear` (tested); the time is
not: 1.1-1.3x faster at 64 rows, 1.35-1.65x at 16 rows and 1.2-1.5x at 1 (decode steps),
1.03-1.06x at 256 rows and more (prefill), default model's shapes, 2 threads, weights from RAM
(`python benchmarks/bench_linear.py --threads 2 --dtype bfloat16 --rows 1,16,64,256`).
vLLM's CPU backend prepacks its oneDNN GEMMs the same way.

float32 is packed too: oneDNN's float32 kernel on a packed weight is 1.3-1.7x MKL's `F.linear`
on the projections (64 and 2,048 rows) and 2.6x on the 49,152-row LM head at 64 rows
(`bench_linear.py --dtype float32`). It adds the products in another order than MKL, so its
results differ from `F.linear`'s in the last bits, as any two GEMM kernels' do (the skinny
weight-first path of `engine.model.linear` did too); greedy and seeded outputs still equal
transformers' token for token in the suite's float32 tests.

The packed weight replaces the parameter (same bytes, another layout); a tied LM head keeps the
embedding as it is and gets a packed copy of its own (the embedding lookup needs plain rows).
Only CPU weights are packed, bf16 only where oneDNN supports bf16 on this CPU.
`PDSERVE_DISABLE_PREPACK=1` keeps every weight plain (`F.linear`).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Attributes of the model's modules that only `linear()` reads.
LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head")


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device get packed: bfloat16 (where oneDNN has bf16
    GEMMs on this CPU) and float32, on the CPU."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepack_linear_weights(model: nn.Module) -> int:
    """Packs every CPU weight in LINEAR_WEIGHTS of `model`'s modules (bf16 and float32, see
    `can_prepack`); returns how many."""
    if os.environ.get("PDSERVE_DISABLE_PREPACK") == "1":
        return 0
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
        logger.info("prepacked %d linear weights for oneDNN", packed)
    return packed
