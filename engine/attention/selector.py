"""Picks the attention backend for a device: Triton on CUDA, PyTorch (with the compiled CPU
decode kernel) on the CPU."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend


def backend_for_device(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """`name` "auto" chooses by device; "torch" / "triton" force a backend (Triton on the CPU
    only runs under TRITON_INTERPRET=1, which the kernels' wrappers check)."""
    kind = torch.device(device).type
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton" or (name == "auto" and kind == "cuda"):
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "auto" and kind == "cpu":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"device {device!r} is not supported: use 'cpu' or 'cuda[:N]'")
