"""A real KV store server and a tiny Llama with a 2,048-token context for connector tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.service import KVStoreService, StoreOptions

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


@pytest.fixture
def store() -> Iterator[KVStoreService]:
    with KVStoreService(StoreOptions(capacity="512MiB", port=0)) as service:
        yield service


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    import os

    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(4321)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama-2k")
    model.save_pretrained(path)
    env = os.environ.get("PDSERVE_TEST_TOKENIZER_DIR")
    source = Path(env) if env else request.getfixturevalue("default_model_dir")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path
