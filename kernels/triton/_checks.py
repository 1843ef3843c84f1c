"""Input checks shared by the Triton kernel wrappers. Each raises ValueError naming the argument,
and none reads tensor contents (no host sync), so a wrapper can run its checks under CUDA graphs."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def interpreter_enabled() -> bool:
    """Whether Triton kernels in this process run in the interpreter (read at decoration time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_cuda_or_interpreter(t: torch.Tensor, name: str = "tensor") -> None:
    """CUDA tensors always; CPU tensors only under `TRITON_INTERPRET=1`."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(f"{name} must be a CUDA tensor (CPU tensors need TRITON_INTERPRET=1), "
                     f"got {t.device}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """`t` lives on `device` (the device of the wrapper's first tensor)."""
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")


def check_dtype(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] | torch.dtype) -> None:
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be {names}, got {str(t.dtype).removeprefix('torch.')}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """`t.shape` equals `shape`; a None entry matches any size."""
    if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want_s}, got {list(t.shape)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    """Every index of dim 0 is a contiguous row (the dim-0 stride may be anything, e.g. a slice
    of a fused qkv output); zero-size tensors pass."""
    if t.numel() == 0:
        return
    if not t[0].is_contiguous():
        raise ValueError(f"{name} must be contiguous within each row of dim 0, got strides {t.stride()}")
