"""What the engine takes from a model folder besides weights: every end-of-sequence id (Gemma 3's
generation config lists <eos> and <end_of_turn>; both end a sample, as in vLLM), and a context
limit the KV cache can hold when none was asked for."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams


def test_every_eos_id_of_the_generation_config_ends_a_sample(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path,
        hf_greedy: Callable[..., list[list[int]]]) -> None:
    from engine.llm import LLM

    source = tiny_model_dir("llama")
    prompt = list(range(500, 520))
    free_run = hf_greedy(source, [prompt], 16)[0]
    second_eos = free_run[5]  # the model's 6th greedy token becomes an end-of-sequence id
    path = tmp_path / "model"
    shutil.copytree(source, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, second_eos]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model=str(path), num_threads=1)
    # what a prefill worker checks its first token against (services/worker/servicer.py)
    assert llm.processor.eos_token_id == 2 and llm.processor.extra_eos_token_ids == [second_eos]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    first = free_run.index(second_eos)
    assert list(out.outputs[0].token_ids) == free_run[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    ignoring = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0]
    assert list(ignoring.outputs[0].token_ids) == free_run


def test_unset_max_model_len_shrinks_to_what_the_cache_holds(
        tiny_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture) -> None:
    from engine.llm import LLM

    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(tiny_model_dir("llama")), num_threads=1, num_kv_blocks=10, block_size=16)
    assert llm.engine_core.config.model_len == 9 * 16  # the model's own limit is 512
    assert "cannot hold one request of the model's limit 512" in caplog.text
