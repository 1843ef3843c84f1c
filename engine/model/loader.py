"""Finding and loading a model: the default model, a local Hugging Face folder, or a hub id."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.model.causal_lm import CausalLM
from engine.model.models import SUPPORTED_ARCHITECTURES, architecture_of
from engine.model.prepack import prepack_linear_weights
from engine.model.sources.catalog import CATALOG, resolve_catalog
from engine.parallel.group import TensorParallel

__all__ = ["SUPPORTED_ARCHITECTURES", "load_config", "load_model", "model_eos_token_ids",
           "resolve_model_path"]
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def resolve_model_path(model: str) -> Path:
    """A folder holding config.json for `model`: a catalog model's name (engine/model/sources/catalog.py:
    the default model, gemma-3-270m; fetched, converted and cached on first use), a local
    `.gguf` file (converted and cached on first use), an existing local folder, or a hub id
    already downloadable."""
    converted = resolve_catalog(model)
    if converted is not None:
        return converted
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return local
    if local.is_dir():
        raise ValueError(f"model {model!r}: the folder has no config.json; {_FOLDER}")
    if local.exists() or model.startswith(("/", ".", "~")):
        what = "is a file but not a .gguf file" if local.exists() else "does not exist"
        raise ValueError(f"model {model!r}: {what}; {_FOLDER}, or a .gguf file")
    try:
        return _snapshot(model)
    except Exception as exc:
        raise ValueError(f"model {model!r} is not one pdserve can serve: not a catalog model, a local "
                         f"folder or .gguf file, nor a hub id in the local Hugging Face cache "
                         f"({type(exc).__name__}).\n{served_models_text()}") from exc


# What a local model folder must hold (the loader reads these).
_FOLDER = ("a model folder must hold config.json, the weights (*.safetensors) and the tokenizer's "
           "files (tokenizer.json or tokenizer.model, tokenizer_config.json)")


def served_models_text() -> str:
    """What `--model` takes, the catalog's models by name."""
    names = ", ".join(m.name + (" (the default)" if i == 0 else "") for i, m in enumerate(CATALOG))
    return (f"--model takes:\n  - a catalog model by name: {names}\n  - a local .gguf file\n"
            f"  - a local Hugging Face folder: {_FOLDER}\n  - a hub id already in the Hugging Face cache")


def _snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True)
    except Exception:
        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in the snapshot of {repo_id}")
    return Path(path)


def load_config(model_path: Path | str) -> Any:
    """The transformers config of `model_path`, checked for a supported architecture (a
    ValueError naming the folder's architecture and the supported ones otherwise)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    try:
        architecture_of(config)
    except ValueError as exc:
        raise ValueError(f"{exc} (model {model_path})") from None
    return config


def iter_safetensors(model_path: Path | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's safetensors: the files its
    `model.safetensors.index.json` lists (a sharded checkpoint), else every *.safetensors."""
    import json

    from safetensors import safe_open

    index = Path(model_path) / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [Path(model_path) / shard for shard in shards]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"shards listed in {index} are missing: {absent}")
    else:
        files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_tensor(name)


def load_model(
    model_path: Path | str,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
) -> tuple[CausalLM, Any]:
    """Builds our model (this rank's shard of it under tensor parallelism) for the folder's config
    and loads its safetensors weights. Returns `(model in eval mode on device, transformers config)`."""
    config = load_config(model_path)
    model = CausalLM(config, attn_backend, dtype=dtype, tp=tp)
    model.load_weights(iter_safetensors(model_path))
    model = model.to(device).eval()
    prepack_linear_weights(model)  # CPU weights, bf16 and float32 (engine.model.prepack)
    return model, config


def load_tokenizer(model_path: Path | str) -> Any:
    """The folder's transformers tokenizer (with its chat template). Thread-safe: transformers'
    lazy first import of AutoTokenizer fails ("cannot import name") when two threads race it
    (workers started together in one process; a grammar thread beside a loading worker)."""
    with _IMPORT_LOCK:
        from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


_IMPORT_LOCK = threading.Lock()


def model_eos_token_ids(model_path: Path | str) -> list[int]:
    """Every end-of-sequence id of the model folder: its config's, then its generation
    config's (lists in both for chat models: Gemma 3's [<eos>, <end_of_turn>], Llama 3.1's
    [<|end_of_text|>, <|eom_id|>, <|eot_id|>])."""
    import json

    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(model_path) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for eos in value if isinstance(value, list) else [value]:
            if isinstance(eos, int) and not isinstance(eos, bool) and eos not in ids:
                ids.append(eos)
    return ids


def model_max_len(hf_config: Any) -> int:
    """The model's context limit (`max_position_embeddings`)."""
    return int(hf_config.max_position_embeddings)
