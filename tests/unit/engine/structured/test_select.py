"""choose_backend: every kind gets a backend that compiles it (xgrammar first, as vLLM's auto),
schemas xgrammar would not fully enforce go to llguidance, and a bad spec is a ValueError that
names the field it came from (the router turns it into a 400 with that `param`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from engine.structured.params import StructuredOutputsParams as SOP
from engine.structured.select import choose_backend

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
LEGACY_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
              "triggers": ["<f>"]}


@pytest.mark.parametrize(("params", "backend"), [
    (SOP(json=SCHEMA), "xgrammar"),
    (SOP(json=SCHEMA, disable_any_whitespace=True), "xgrammar"),
    (SOP(json_object=True), "xgrammar"),
    (SOP(regex=r"\d{3}-[a-z]+"), "xgrammar"),
    (SOP(choice=["yes", "no"]), "xgrammar"),
    (SOP(grammar='root ::= "a" | "b" rest\nrest ::= [0-9]+'), "xgrammar"),
    (SOP(grammar='start: "a" | "b" NUM\nNUM: /[0-9]+/'), "xgrammar"),  # Lark
    (SOP(structural_tag=json.dumps(TAG)), "xgrammar"),
    (SOP(structural_tag=json.dumps(LEGACY_TAG)), "xgrammar"),  # vLLM's older form
    (SOP(json=SCHEMA, whitespace_pattern=r"[ ]?"), "guidance"),  # xgrammar has none
    (SOP(json={"type": "object", "patternProperties": {"^x": {"type": "integer"}}}), "guidance"),
], ids=lambda v: v if isinstance(v, str) else v.kind)
def test_auto_picks_xgrammar_unless_it_cannot_take_the_spec(params: SOP, backend: str) -> None:
    chosen = choose_backend(params)
    assert chosen.backend == backend
    assert chosen == SOP(**{**params.__dict__, "backend": backend})  # nothing else changed


@pytest.mark.parametrize("kind", ["json", "json_object", "regex", "choice", "grammar"])
def test_an_explicit_backend_is_used_alone(kind: str) -> None:
    params = {"json": SOP(json=SCHEMA), "json_object": SOP(json_object=True),
              "regex": SOP(regex="a+"), "choice": SOP(choice=["x"]),
              "grammar": SOP(grammar='root ::= "a"')}[kind]
    assert choose_backend(params, "xgrammar").backend == "xgrammar"
    assert choose_backend(params, "guidance").backend == "guidance"


def test_structural_tags_and_whitespace_patterns_need_their_one_backend() -> None:
    with pytest.raises(ValueError, match="guidance: llguidance has no structural tags"):
        choose_backend(SOP(structural_tag=json.dumps(TAG)), "guidance")
    with pytest.raises(ValueError, match="xgrammar has no whitespace_pattern"):
        choose_backend(SOP(json=SCHEMA, whitespace_pattern=" "), "xgrammar")


# One case per gap: the schema, and a JSON text it rejects that xgrammar's grammar accepts.
XGRAMMAR_GAPS: dict[str, tuple[dict[str, Any], str]] = {
    "number multipleOf": ({"type": "number", "multipleOf": 0.5}, "1.3"),
    "allOf of two": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    "maxLength beside format": ({"type": "string", "format": "email", "maxLength": 5},
                                '"abc@d.com"'),
    "maxLength beside pattern": ({"type": "string", "pattern": "^a*$", "maxLength": 2}, '"aaa"'),
    "minimum beside $ref": ({"$defs": {"x": {"type": "integer"}}, "type": "object",
                             "properties": {"a": {"$ref": "#/$defs/x", "minimum": 5}},
                             "required": ["a"]}, '{"a": 1}'),
    "required not in properties": ({"type": "object", "required": ["z"]}, "{}"),
    "dependentRequired": ({"type": "object", "properties": {"a": {}, "b": {}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
}


@pytest.mark.parametrize("name", list(XGRAMMAR_GAPS))
def test_schemas_xgrammar_would_not_enforce_go_to_llguidance(name: str) -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema, invalid = XGRAMMAR_GAPS[name]
    # the gap is real: jsonschema rejects what xgrammar's grammar accepts
    assert not jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.FormatChecker()).is_valid(json.loads(invalid))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, invalid), "xgrammar closed this gap"
    assert choose_backend(SOP(json=schema), "xgrammar").backend == "xgrammar"  # when asked for
    if name == "dependentRequired":  # llguidance lacks it too: refused, never silently lax
        with pytest.raises(ValueError, match="does not enforce dependentRequired"):
            choose_backend(SOP(json=schema))
    else:
        assert choose_backend(SOP(json=schema)).backend == "guidance"


def test_a_gap_llguidance_cannot_compile_either_is_refused_with_both_reasons() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ValueError) as e:
        choose_backend(SOP(json=schema, source="response_format.json_schema.schema"))
    assert str(e.value).startswith("response_format.json_schema.schema: cannot be compiled")
    assert "xgrammar: does not enforce uniqueItems" in str(e.value)
    assert "guidance: Unimplemented keys" in str(e.value)


def test_property_names_that_spell_keywords_are_not_gaps() -> None:
    schema = {"type": "object", "required": ["not", "if", "contains"],
              "properties": {k: {"type": "integer"} for k in ("not", "if", "contains")},
              "$defs": {"allOf": {"type": "string"}}}
    assert choose_backend(SOP(json=schema)).backend == "xgrammar"


def test_schemas_xgrammar_enforces_stay_on_it() -> None:
    schema = {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer",
                                                                     "multipleOf": 3}},
                              "required": ["x"]}},
              "type": "object",
              "properties": {"p": {"$ref": "#/$defs/p", "description": "a point"},
                             "d": {"type": "string", "format": "date"},
                             "s": {"type": "string", "maxLength": 4},
                             "one": {"allOf": [{"type": "boolean"}]},
                             "l": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
              "required": ["p", "d"]}
    assert choose_backend(SOP(json=schema)).backend == "xgrammar"


SOURCE = "response_format.json_schema.schema"


@pytest.mark.parametrize(("params", "message"), [
    (SOP(json="{not json", source=SOURCE), f"{SOURCE}: is not valid JSON"),
    (SOP(json="[1, 2]", source=SOURCE), f"{SOURCE}: a JSON schema must be a JSON object"),
    (SOP(json={"type": "objekt"}, source=SOURCE), f"{SOURCE}: invalid JSON schema at type"),
    (SOP(json={"type": "object", "required": "a"}, source=SOURCE),
     f"{SOURCE}: invalid JSON schema at required: 'a' is not of type 'array'"),
    (SOP(json={"properties": {"a": {"minimum": "3"}}}, source=SOURCE),
     f"{SOURCE}: invalid JSON schema at properties/a/minimum"),
    (SOP(choice=[], source="structured_outputs.choice"),
     "structured_outputs.choice: the choice list must not be empty"),
    (SOP(choice=["a", 1], source="guided_choice"),  # type: ignore[list-item]
     "guided_choice: every choice must be a string"),
    (SOP(regex="a(", source="structured_outputs.regex"),
     "structured_outputs.regex: cannot be compiled .*parenthesis is not closed"),
    (SOP(regex="(a)\\1", source="guided_regex"), "guided_regex: cannot be compiled .*ackreference"),
    (SOP(grammar="root ::= foo", source="structured_outputs.grammar"),
     'structured_outputs.grammar: cannot be compiled .*Rule "foo" is not defined'),
    (SOP(grammar="start: foo", source="guided_grammar"),
     "guided_grammar: cannot be compiled .*unknown name"),  # Lark
    (SOP(grammar="   ", source="guided_grammar"), "guided_grammar: the grammar must be a non-empty"),
    (SOP(structural_tag="[1]", source="structured_outputs.structural_tag"),
     "structured_outputs.structural_tag: a structural tag must be a JSON object"),
    (SOP(regex="a" * (256 * 1024 + 1), source="structured_outputs.regex"),
     "structured_outputs.regex: the spec has 262145 characters"),
], ids=lambda v: v if isinstance(v, str) else v.kind)
def test_a_bad_spec_is_a_value_error_naming_its_field(params: SOP, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        choose_backend(params)


def test_an_unknown_preferred_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend(SOP(regex="a"), "outlines")
