"""Prepare a Hugging Face model folder that vLLM (CPU) loads, from pdserve's model folder.

    .peers/vllm/bin/python loadtest/peers/prepare_vllm_model.py SRC_DIR OUT_DIR

SRC_DIR is what pdserve's `resolve_model_path(DEFAULT_MODEL)` gives: config.json,
model.safetensors, tokenizer files and chat template. OUT_DIR gets the same files (the weights
hard-linked when on the same file system, else copied) with a config.json that vLLM accepts:
`architectures == ["LlamaForCausalLM"]` and float32 weights. Standard library only, so it runs
in any venv.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
ARCHITECTURE = "LlamaForCausalLM"


def vllm_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with what vLLM needs to pick its Llama implementation and dtype."""
    if config.get("model_type") not in ("llama", None):
        raise ValueError(f"not a Llama-family config: model_type={config.get('model_type')!r}")
    out = dict(config)
    out["architectures"] = [ARCHITECTURE]
    out["model_type"] = "llama"
    out.setdefault("torch_dtype", "float32")
    out.setdefault("dtype", out["torch_dtype"])
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prepare(src: Path, out: Path) -> Path:
    """Write OUT_DIR from SRC_DIR (atomically: into a sibling temp folder, then renamed)."""
    missing = [name for name in REQUIRED_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} lacks {missing}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if not path.is_file():
            continue
        if path.name == "config.json":
            config = json.loads(path.read_text())
            (tmp / "config.json").write_text(json.dumps(vllm_config(config), indent=2) + "\n")
        elif path.suffix == ".safetensors":
            _link_or_copy(path, tmp / path.name)
        else:
            shutil.copy2(path, tmp / path.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = prepare(Path(argv[0]).resolve(), Path(argv[1]).resolve())
    print(f"vllm peer model prepared at {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
