"""The engine with the Triton attention backend equals transformers token for token.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1), so this checks the backend's wiring (cache writes, the decode kernel
on pure decode steps, the prefill kernel on chunked, prefix-hit and mixed steps) on the CPU.
On a GPU, tests/integration/test_engine_gpu.py runs the same modes on CUDA with CUDA graphs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from tests.integration.test_engine_vs_transformers import MODES, tiny_prompts

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU run of the Triton kernels needs the interpreter")

NEW_TOKENS = 12


# batch by default; the other modes (~19 s in Triton's CPU interpreter) with --runslow, where a
# GPU session runs them on CUDA. Each kernel is checked against its reference in tests/unit.
# Gemma 2 (windows on alternate layers, soft-capping) and windowed Mistral (blocks freed behind
# the window) take the kernels' window and cap paths.
@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "mistral_window"])
@pytest.mark.parametrize("mode", ["batch", *(pytest.param(m, marks=pytest.mark.slow)
                                             for m in ("chunked", "preempt", "prefix"))])
def test_triton_backend_matches_transformers(arch: str, mode: str,
                                             tiny_model_dir: Callable[[str], Path],
                                             hf_greedy: Callable[..., list[list[int]]]) -> None:
    from engine.llm import LLM

    path = tiny_model_dir(arch)
    prompts = tiny_prompts()[:6]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(model=str(path), attention_backend="triton", num_threads=1, **MODES[mode])
    core = llm.engine_core
    assert core.runner.model.layers[0].self_attn.backend.name == "triton"
    start = core.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if mode == "prefix":
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        assert sum(o.num_cached_tokens for o in again) > 0
    end = core.get_stats()
    assert end.num_free_blocks == start.num_free_blocks
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
