"""On a CUDA device (Triton attention backend): greedy float32 output equals transformers
`generate` token for token in every scheduling mode, with decode CUDA graphs and without
(`enforce_eager`); no KV block leaks. transformers runs on the same GPU in float32 (no TF32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_engine_vs_transformers import (
    ARCHS,
    MAX_NEW,
    MODES,
    greedy,
    sized,
    tiny_prompts,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hf_greedy_cuda() -> Callable[[Path, list[list[int]], int], list[list[int]]]:
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models: dict[str, Any] = {}

    def run(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        if str(path) not in models:
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            hf.generation_config.eos_token_id = None
            models[str(path)] = hf.to("cuda").eval()
        model = models[str(path)]
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new, pad_token_id=2)
            outs.append(gen[0, len(p):].tolist())
        return outs

    return run


@pytest.mark.parametrize("eager", [False, True], ids=["cudagraphs", "eager"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)  # every architecture: windows, hybrid KV cache groups
# (Gemma 2/3: per-group block tables in the CUDA graphs), capping, MoE (fused Triton)
def test_gpu_engine_matches_transformers(arch: str, mode: str, eager: bool,
                                         tiny_model_dir: Callable[[str], Path],
                                         hf_greedy_cuda: Callable[..., list[list[int]]]) -> None:
    from engine.llm import LLM

    path = tiny_model_dir(arch)
    prompts = tiny_prompts()
    expected = hf_greedy_cuda(path, prompts, MAX_NEW)
    kwargs = sized(path, dict(MODES[mode]))  # hybrid models: their KV cache groups' pages
    if "num_kv_blocks" not in kwargs:
        kwargs["kv_cache_gib"] = 0.25
    llm = LLM(model=str(path), device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=16,
              **kwargs)
    core = llm.engine_core
    assert (core.runner.decode_graphs is None) == eager
    start = core.get_stats()
    n = 2 if mode == "n2" else 1
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    if mode == "prefix":
        again = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    if mode == "preempt":
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption was forced"
    end = core.get_stats()
    assert end.num_free_blocks == start.num_free_blocks == end.num_total_blocks
    for i, (o, want) in enumerate(zip(outs, expected, strict=True)):
        for c in o.outputs:
            assert list(c.token_ids) == want, f"prompt {i} (len {len(prompts[i])}) differs"


def test_gpu_kv_cache_is_sized_from_free_memory(tiny_model_dir: Callable[[str], Path]) -> None:
    """No size given: the cache takes what gpu_memory_utilization leaves (more than 1 GiB here)."""
    from engine.kv_cache_sizing import kv_cache_bytes_per_block
    from engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir("llama")), device="cuda", dtype="float32",
              gpu_memory_utilization=0.3, enforce_eager=True)
    core = llm.engine_core
    per_block = kv_cache_bytes_per_block(2, 2, 16, core.config.block_size, torch.float32)
    cache_gib = core.num_blocks * per_block / 2**30
    total_gib = torch.cuda.mem_get_info()[1] / 2**30
    assert 0.1 * total_gib < cache_gib < 0.3 * total_gib
