"""A GGUF file to a Hugging Face folder: config.json, model.safetensors (float32, dequantized by
transformers, under transformers' own parameter names), the tokenizer with its chat template, and
generation_config.json.

The chat template is the file's `tokenizer.chat_template`, else pdserve's for the architecture
(engine/model/sources/chat_templates.py). `architectures` is the transformers class that loaded the
weights (LlamaForCausalLM, Gemma3ForCausalLM, ...); the eos ids are the file's eos plus the
architecture's end-of-turn tokens (Gemma's <end_of_turn>), in config.json and
generation_config.json alike. A Gemma 3 file's linear RoPE scaling, which transformers does not
read, is put back (`restore_rope_scaling`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.model.sources.chat_templates import EXTRA_EOS_TOKENS, FALLBACK_TEMPLATES


def gguf_metadata(gguf: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of those metadata `keys` the file has (memory-mapped: no tensor is read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    return {key: fields[key].contents() for key in keys if key in fields}


def gguf_architecture(gguf: Path) -> str:
    arch = gguf_metadata(gguf, ("general.architecture",)).get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{gguf} has no general.architecture: not a model GGUF file")
    return arch


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` with transformers and save a float32 safetensors + tokenizer folder."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = gguf_architecture(gguf)
    with tqdm(total=4, desc=f"converting {gguf.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template and arch in FALLBACK_TEMPLATES:
            tokenizer.chat_template = FALLBACK_TEMPLATES[arch]
        tokenizer.save_pretrained(out_dir)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        config = model.config
        tied = bool(config.tie_word_embeddings)
        state = {
            name: tensor.detach().to(torch.float32).contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight") and "rotary_emb" not in name
        }
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        restore_rope_scaling(config, gguf, arch)
        config.dtype = "float32"
        eos = eos_token_ids(config.eos_token_id, tokenizer, EXTRA_EOS_TOKENS.get(arch, ()))
        config.eos_token_id = eos
        config.save_pretrained(out_dir)
        _add_torch_dtype(out_dir / "config.json")
        model.generation_config.eos_token_id = eos
        model.generation_config.save_pretrained(out_dir)
        bar.update()


def restore_rope_scaling(config: Any, gguf: Path, arch: str) -> None:
    """transformers reads no `rope.scaling.*` of a Gemma 3 file; llama.cpp applies a linear one
    (Gemma 3 4B and larger: factor 8) to the global-attention layers only. Put it back there."""
    keys = (f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor")
    meta = gguf_metadata(gguf, keys) if arch == "gemma3" else {}
    factor = float(meta.get(keys[1], 1.0))
    if meta.get(keys[0]) != "linear" or factor == 1.0:
        return
    params = dict(config.rope_parameters or {})
    full = dict(params.get("full_attention") or {})
    if full.get("rope_type", "default") == "default":
        params["full_attention"] = {**full, "rope_type": "linear", "factor": factor}
        config.rope_parameters = params


def eos_token_ids(eos: int | list[int] | None, tokenizer: Any,
                  extra_tokens: tuple[str, ...]) -> int | list[int]:
    """The file's eos id(s) and those of `extra_tokens` (ones the vocabulary has): one int when
    there is one (as the file says it), else the list, the file's first."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in extra_tokens if token in vocab and vocab[token] not in ids]
    if not ids:
        raise ValueError("the GGUF file names no eos token")
    return ids[0] if len(ids) == 1 else ids


def _add_torch_dtype(config_file: Path) -> None:
    """Older readers look for `torch_dtype`; transformers 5 writes only `dtype`."""
    data = json.loads(config_file.read_text())
    data["torch_dtype"] = data.get("dtype", "float32")
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
