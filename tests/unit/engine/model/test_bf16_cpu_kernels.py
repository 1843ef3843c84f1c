"""A bf16 model on the CPU runs its norms, residual adds and rotary through the fused C kernels
(kernels/cpu/fused_ops.c); with the kernels off it runs the PyTorch references. Both give the
same logits up to bf16 rounding of the norms (rotary and adds are bit-exact, see the kernel
tests), for plain, untied-GQA and q/k-norm (Qwen3) layouts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.causal_lm import CausalLM
from kernels.cpu import fused_ops
from tests.unit.engine.model.conftest import make_hf_model

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="no C compiler: kernel not built")


@pytest.mark.parametrize("name", ["llama_tied", "llama_untied_gqa1", "qwen3"])
def test_fused_kernels_match_the_pytorch_path(name: str, paged_driver: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    hf_model = make_hf_model(name)
    model = CausalLM(hf_model.config, TorchAttentionBackend(), dtype=torch.bfloat16)
    model.load_weights(hf_model.state_dict().items())  # rotary tables stay float32
    calls = {"norm": 0, "rotary": 0}
    norm, rotary = fused_ops.add_rms_norm, fused_ops.rotary_

    def counted_norm(*a: Any, **k: Any) -> Any:
        calls["norm"] += 1
        return norm(*a, **k)

    def counted_rotary(*a: Any, **k: Any) -> Any:
        calls["rotary"] += 1
        return rotary(*a, **k)

    monkeypatch.setattr(fused_ops, "add_rms_norm", counted_norm)
    monkeypatch.setattr(fused_ops, "rotary_", counted_rotary)
    batch = [("a", list(range(3, 20))), ("b", [5, 9, 11])]
    fused = paged_driver(model).step(batch)
    assert calls["norm"] >= 2 * model.num_layers + 1 and calls["rotary"] >= model.num_layers
    monkeypatch.setattr(fused_ops, "available", lambda: False)
    calls.update(norm=0, rotary=0)
    plain = paged_driver(model).step(batch)
    assert calls == {"norm": 0, "rotary": 0}
    for rid in ("a", "b"):
        torch.testing.assert_close(fused[rid].float(), plain[rid].float(), atol=0.1, rtol=0.05)
        assert torch.equal(fused[rid][-1].argmax(), plain[rid][-1].argmax())
