"""Small Triton device functions the kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32. IEEE: exact fp32 products (no TF32). UPCAST: interpreter only, whose
    tl.dot multiplies bfloat16 bit patterns as integers (triton 3.9), so multiply in fp32."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)
