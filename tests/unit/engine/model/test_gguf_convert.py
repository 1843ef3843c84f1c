"""GGUF to Hugging Face folder conversion, on a tiny random Gemma 3 file (no network, ~5 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model.sources.chat_templates import GEMMA3_CHAT_TEMPLATE
from engine.model.sources.gguf_convert import convert_gguf
from tests.unit.engine.model.tiny_gguf import END_OF_TURN, write_tiny_gemma3


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny GGUF file, its converted folder)."""
    folder = tmp_path_factory.mktemp("gguf")
    gguf = write_tiny_gemma3(folder / "tiny.gguf")
    out = folder / "out"
    out.mkdir()
    convert_gguf(gguf, out)
    return gguf, out


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_config_names_the_text_only_gemma3_class_and_end_of_turn_as_eos(converted: tuple[Path, Path]) -> None:
    _, out = converted
    config = _json(out / "config.json")
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == [1, END_OF_TURN]  # the file's <eos>, then <end_of_turn>
    assert _json(out / "generation_config.json")["eos_token_id"] == [1, END_OF_TURN]
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 16


def test_weights_are_float32_under_transformers_names_and_give_the_gguf_logits(
    converted: tuple[Path, Path],
) -> None:
    gguf, out = converted
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert {handle.get_tensor(n).dtype for n in names} == {torch.float32}
    assert names == set(ours.state_dict()) - {"lm_head.weight"}  # tied to the embedding
    tokens = torch.tensor([[2, 5, 7, 9, 10, 11, 6, 20, 21, 1]])
    with torch.no_grad():
        assert torch.equal(ours(tokens).logits, reference(tokens).logits)


def test_a_file_without_a_chat_template_gets_pdserves_gemma_template(converted: tuple[Path, Path]) -> None:
    _, out = converted
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == GEMMA3_CHAT_TEMPLATE
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": [{"type": "text", "text": "sat?"}]}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
                    "<start_of_turn>model\nthe cat<end_of_turn>\n"
                    "<start_of_turn>user\nsat?<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [2, 5] and ids.count(END_OF_TURN) == 3  # <bos>, <start_of_turn>: whole tokens
    assert tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False) == (
        "<bos><start_of_turn>user\nx<end_of_turn>\n")
    with pytest.raises(Exception, match="not 'tool'"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "{}"}], tokenize=False)


def test_linear_rope_scaling_is_restored_on_the_global_layers_only(tmp_path: Path) -> None:
    gguf = write_tiny_gemma3(tmp_path / "scaled.gguf", rope_linear_factor=8.0)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(gguf, out)
    rope = _json(out / "config.json")["rope_parameters"]
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    config = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).config
    assert config.rope_parameters["full_attention"]["factor"] == 8.0
