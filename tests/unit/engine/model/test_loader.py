"""Model resolution and loading: local folders, the default model, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.loader import load_model, load_tokenizer, model_max_len, resolve_model_path
from engine.model.sources import catalog


def _save_tiny(folder: Path, **overrides: Any) -> Any:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=96, tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def test_local_folder_resolves_to_itself_and_loads_hf_weights(tmp_path: Path, paged_driver) -> None:
    hf_model = _save_tiny(tmp_path)
    assert resolve_model_path(str(tmp_path)) == tmp_path
    model, config = load_model(tmp_path, torch.float32, TorchAttentionBackend())
    assert model_max_len(config) == 96
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (2, 2, 8, 128)
    tokens = list(range(5, 25))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert_close(paged_driver(model).step([("a", tokens)])["a"], expected, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_rejected_by_name(tmp_path: Path) -> None:
    _save_tiny(tmp_path)
    config_file = tmp_path / "config.json"
    data = json.loads(config_file.read_text())
    data["architectures"] = ["GPTNeoXForCausalLM"]
    config_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_model(tmp_path, torch.float32, TorchAttentionBackend())


def test_sharded_moe_checkpoint_loads_from_its_index(tmp_path: Path, paged_driver) -> None:
    """A sharded checkpoint (model.safetensors.index.json), its experts one tensor each as
    checkpoints on disk keep them (transformers 5 fuses them in memory only); a stray
    safetensors file the index does not list is not read."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           max_position_embeddings=96, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-0000*-of-*.safetensors"))) > 2
    from safetensors.torch import save_file

    save_file({"junk": torch.zeros(3)}, str(tmp_path / "stray.safetensors"))
    model, _ = load_model(tmp_path, torch.float32, TorchAttentionBackend())
    tokens = list(range(5, 25))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert_close(paged_driver(model).step([("a", tokens)])["a"], expected, atol=1e-4, rtol=1e-4)


def test_unknown_model_name_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not one pdserve can serve") as e:
        resolve_model_path("no/such/model-x")
    text = str(e.value)
    # the models it can serve by name, what a folder must hold; not the hub library's own advice
    assert "smollm2-135m-instruct (the default), gemma-3-270m" in text and "config.json" in text
    assert "internet connection" not in text
    with pytest.raises(ValueError, match=r"the folder has no config\.json; a model folder must hold"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    _save_tiny(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_weight"):
        load_model(tmp_path, torch.float32, TorchAttentionBackend())


def test_default_model_matches_transformers_greedy_and_converts_once(
    monkeypatch: pytest.MonkeyPatch, paged_driver
) -> None:
    path = resolve_model_path("SmolLM2-135M-Instruct")  # converts on first use (~20 s)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config

    def no_conversion(*args: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(catalog, "convert_gguf", no_conversion)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == path

    ours, _ = load_model(path, torch.float32, TorchAttentionBackend())
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template
    eos = config["eos_token_id"]
    for i, question in enumerate(["What is the capital of France?", "Write a haiku about rain."]):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16,
                                         do_sample=False)[0, len(prompt):].tolist()
        driver = paged_driver(ours, num_blocks=8, block_size=16)
        got, new = [], prompt
        for _ in range(16):
            token = int(driver.step([(str(i), new)])[str(i)][-1].argmax())
            got.append(token)
            new = [token]
            if token == eos:
                break
        assert got == expected
