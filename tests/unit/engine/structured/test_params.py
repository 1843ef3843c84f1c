"""StructuredOutputsParams: exactly one constraint; a JSON schema kept as text in its own key
order (the order `properties` are written in is the order the output writes them); the wire
form (msgspec, the engine-core process boundary) gives back the same value."""

from __future__ import annotations

import json

import pytest

from engine.core.outputs import EngineCoreRequest
from engine.sampling_params import SamplingParams
from engine.serial import ADD, MessageCodec
from engine.structured.params import KINDS
from engine.structured.params import StructuredOutputsParams as SOP


def test_none_or_two_constraints_are_refused_naming_the_source() -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs must set exactly one of .* got none"):
        SOP()
    with pytest.raises(ValueError, match=r"^guided_json must set exactly one of .* got json, regex"):
        SOP(json="{}", regex="a", source="guided_json")
    with pytest.raises(ValueError, match="got none"):
        SOP(json_object=False)  # False asks for nothing


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_alone_is_accepted(kind: str) -> None:
    value = {"json": "{}", "regex": "a", "choice": ["a"], "grammar": 'root ::= "a"',
             "json_object": True, "structural_tag": "{}"}[kind]
    assert SOP(**{kind: value}).kind == kind


def test_a_schema_dict_is_kept_as_json_text_in_its_key_order() -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "string"}}}
    params = SOP(json=schema)
    assert params.json == json.dumps(schema)
    assert list(params.schema()["properties"]) == ["zeta", "alpha"]  # type: ignore[index]
    assert params == SOP(json=json.dumps(schema))


def test_the_cache_key_holds_every_field_that_changes_the_grammar() -> None:
    base = SOP(choice=("a", "b"))  # type: ignore[arg-type]
    assert base.choice == ["a", "b"] and base.spec == '["a", "b"]'
    keys = {base.key, SOP(regex='["a", "b"]').key, SOP(choice=["a", "b"], backend="guidance").key,
            SOP(json="{}").key, SOP(json="{}", disable_any_whitespace=True).key,
            SOP(json="{}", whitespace_pattern=" ").key}
    assert len(keys) == 6
    assert SOP(choice=["a"], source="x").key == SOP(choice=["a"], source="y").key


def test_params_cross_the_engine_core_process_boundary_unchanged() -> None:
    codec = MessageCodec()
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "null"}}}
    for params in (SOP(json=schema, disable_any_whitespace=True, backend="xgrammar",
                       source="response_format.json_schema"),
                   SOP(choice=["x", "y"]), SOP(json_object=True, whitespace_pattern=" *")):
        request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=params))
        _, back = codec.decode(codec.encode(ADD, request))
        got = back.sampling_params.structured_outputs
        assert isinstance(got, SOP) and got == params and got.source == params.source
        assert got.json == params.json  # the schema's text, key order and all
