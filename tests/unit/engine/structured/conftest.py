"""The structured-output tests' shared fixtures: a manager over the default model's tokenizer
(49,152 tokens, eos 2), one per module, and that tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.structured.manager import StructuredOutputManager
from tests.unit.engine.conftest import smollm2_tokenizer_dir

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def manager() -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(str(smollm2_tokenizer_dir()), VOCAB, EOS)
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.model.loader import load_tokenizer

    return load_tokenizer(smollm2_tokenizer_dir())
