"""The structured-output suite (tests/integration/structured_schemas.py: 32 JSON schemas, 5
regexes, 4 choice lists) on the default model, every case in one batch, greedy and seeded
temperature 1.0: every output parses and validates (jsonschema with a format checker, regex
fullmatch, one of the choices) and ends with finish_reason "stop".

The whole suite takes minutes on two CPU cores, so it is `slow`, and so is SUBSET (2-3 min); the
default run checks the suite's own consistency and its checks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import jsonschema
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.select import choose_backend
from tests.integration.structured_schemas import CASES, MAX_TOKENS, SCHEMAS, SUBSET, Case


def test_the_suite_has_thirty_valid_schemas_every_backend_choice_takes() -> None:
    assert len(SCHEMAS) >= 30 and len(CASES) == len({c.name for c in CASES})
    backends = set()
    for case in CASES:
        if case.kind == "json":
            jsonschema.Draft202012Validator.check_schema(case.spec)
        backends.add(choose_backend(case.params()).backend)
    assert backends == {"xgrammar", "guidance"}


@pytest.mark.parametrize(("name", "text"), [
    ("person", '{"name": "Al", "age": 30, "email": "not-an-email"}'),
    ("log_entry", '{"timestamp": "2024-01-02 03:04", "level": "INFO", "message": "x"}'),
    ("short_email", '{"email": "a.very.long.address@example.com"}'),
    ("book", '{"title": "T", "author": "A", "year": 1999, "genres": []}'),
    ("phone", "(12) 345-6789"),
    ("capital", "Rome"),
])
def test_the_checks_refuse_invalid_outputs(name: str, text: str) -> None:
    case = next(c for c in CASES if c.name == name)
    with pytest.raises(AssertionError, match=f"^{name}: "):
        case.check(text)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(max_model_len=1024, num_threads=2)
    yield engine
    engine.shutdown()


def run_suite(llm: LLM, cases: list[Case]) -> float:
    """Every case greedy and seeded at temperature 1.0, in one batch; returns the seconds."""
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=c.params())
              for c in cases]
    params += [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=MAX_TOKENS,
                              structured_outputs=c.params()) for i, c in enumerate(cases)]
    start = time.perf_counter()
    outs = llm.chat([c.messages() for c in cases] * 2, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for case, out in zip(cases * 2, outs, strict=True):
        sample = out.outputs[0]
        case.check(sample.text)
        assert sample.finish_reason == "stop", (case.name, sample.text)
        if case.kind == "json":
            assert isinstance(json.loads(sample.text), dict)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return seconds


@pytest.mark.slow  # 2-3 min on 2 cores; engine structured tests cover the tiny model by default
def test_a_representative_subset_on_the_default_model(llm: LLM,
                                                      record_property: pytest.RecordProperty) -> None:
    record_property("seconds", run_suite(llm, SUBSET))


@pytest.mark.slow
def test_every_case_on_the_default_model(llm: LLM, record_property: pytest.RecordProperty) -> None:
    record_property("seconds", run_suite(llm, CASES))
