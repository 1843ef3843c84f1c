"""`linear(x, weight, bias)`: `F.linear`, with the weight as the left operand for skinny inputs.

A decode step of a few requests multiplies 2..4 rows by every weight matrix. Asked for
`x @ weight.T`, MKL's sgemm first copies (packs) the whole weight, then streams the copy: the
step reads every weight twice. Asked for `(weight @ x.T).T`, it streams the weight once as the
left operand and packs only the few input rows. Measured on this project's 2-core x86 boxes,
SmolLM2-135M shapes, weights read from RAM (`python benchmarks/bench_linear.py`): 1 thread,
4 rows: 0.5..0.6x the time for the 49152-row output head, 0.7x for the fused QKV and gate/up
projections; 2 threads: 0.3..0.5x. At 1 row both orders run the same GEMV; from about 8 rows
on, packing pays for itself and `F.linear` is as fast or faster.

The two orders add the same products in another order, so results may differ in the last bits
(fp32 rounding), as between any two GEMM kernels. Other devices and dtypes use `F.linear`.

A weight prepacked for oneDNN (`engine.model.prepack`: the engine's CPU weights, bf16 and
float32, as opaque mkldnn tensors) goes to `torch.ops.mkldnn._linear_pointwise`: `F.linear`'s
bits in bf16, last-bit differences in float32. The weight-first order above then serves only
weights left plain (`PDSERVE_DISABLE_PREPACK=1`, or models built without the loader).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallel

# Inputs with this many rows go weight-first (2..SKINNY_MAX_ROWS; 1 row is a GEMV either way).
SKINNY_MAX_ROWS = 4


def linear(
    x: torch.Tensor,  # [n, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [n, out_features], contiguous
    """`F.linear(x, weight, bias)`; for 2..SKINNY_MAX_ROWS rows of float32 on the CPU, computed as
    `weight @ x.T` (see the module docstring)."""
    if weight.is_mkldnn:  # prepacked weight (engine.model.prepack)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    n = x.shape[0]
    if not (1 < n <= SKINNY_MAX_ROWS and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()  # [n, out_features]
    return out if bias is None else out.add_(bias)


def row_parallel_linear(
    x: torch.Tensor,  # [n, in_features / tp]: this rank's part of the input
    weight: torch.Tensor,  # [out_features, in_features / tp]
    bias: torch.Tensor | None,  # [out_features], added once, after the sum over ranks
    tp: TensorParallel | None,
) -> torch.Tensor:  # [n, out_features]
    """A row-parallel projection: each rank's partial product, summed over the ranks."""
    if tp is None or tp.size == 1:
        return linear(x, weight, bias)
    out = tp.all_reduce(linear(x, weight))
    return out if bias is None else out.add_(bias)
