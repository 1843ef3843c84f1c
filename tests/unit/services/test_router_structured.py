"""A request's structured-output fields as the one constraint its samples carry (no workers):
every form OpenAI and vLLM write gives the StructuredOutputsParams vLLM would build, named by the
field it came from; two forms at once, a malformed form or a spec no backend compiles is an
OpenAIError 400 naming the field; the backend choice is kept per spec; the worker's wire form
checks a spec against the backend the router chose."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from engine.structured.params import StructuredOutputsParams
from protos import worker_pb2 as pb
from services.router.api.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.api.structured import BackendChoices, requested
from services.router.errors import OpenAIError
from services.worker.convert import structured_from_proto, structured_to_proto

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BASE: dict[str, Any] = {"model": "m", "prompt": "x"}
DEEP = '{"a": ' * 5000 + "1" + "}" * 5000  # valid JSON text, deeper than json.loads recurses


def _body(chat: bool = False, **fields: Any) -> CompletionRequest | ChatCompletionRequest:
    if chat:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    return CompletionRequest.model_validate({**BASE, **fields})


FORMS: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    # request fields -> StructuredOutputsParams fields, source
    ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a_b-9", "schema": SCHEMA,
                                                                 "strict": True, "description": "d"}}},
     {"json": SCHEMA}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}, "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": SCHEMA}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": False}}, {"regex": "[a-z]+"},
     "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]},
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     {"json_object": True, "disable_any_whitespace": True}, "structured_outputs.json_object"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     {"json": SCHEMA, "whitespace_pattern": " ?"}, "structured_outputs.json"),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}, "guided_json"),
    ({"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "[ ]?"},
     {"json": SCHEMA, "whitespace_pattern": "[ ]?"}, "guided_json"),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}, "guided_regex"),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}, "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " "},
     {"json_object": True, "whitespace_pattern": " "}, "response_format"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("fields", "expected", "source"), FORMS,
                         ids=[f[2] + str(i) for i, f in enumerate(FORMS)])
def test_each_form_gives_vllms_constraint_named_by_its_field(chat: bool, fields: dict[str, Any],
                                                             expected: dict[str, Any], source: str) -> None:
    constraint = requested(_body(chat, **fields))
    assert constraint is not None and constraint.backend is None
    assert constraint.params == StructuredOutputsParams(**expected)  # source is not compared
    assert constraint.params.source == source


def test_no_constraint_text_format_and_the_backend_preference() -> None:
    assert requested(_body()) is None
    assert requested(_body(response_format={"type": "text"}, guided_decoding_backend="guidance")) is None
    constraint = requested(_body(guided_regex="a+", guided_decoding_backend="guidance"))
    assert constraint is not None and constraint.backend == "guidance"


def test_structural_tags_in_response_format_take_vllms_two_forms() -> None:
    legacy = requested(_body(response_format={
        "type": "structural_tag", "triggers": ["<f="],
        "structures": [{"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}]}))
    assert legacy is not None and json.loads(legacy.params.structural_tag or "") == {
        "structures": [{"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
    fmt = {"type": "const_string", "value": "hi"}
    tag = requested(_body(response_format={"type": "structural_tag", "format": fmt}))
    assert tag is not None and json.loads(tag.params.structural_tag or "") == {"type": "structural_tag",
                                                                               "format": fmt}
    chosen = BackendChoices().choose(tag.params, "auto")
    assert chosen.backend == "xgrammar"


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a"}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "n", "schema": SCHEMA}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.structures"),
    ({"response_format": {"type": "structural_tag", "format": {}, "triggers": ["a"]}},
     "response_format.format"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[r[1] + str(i) for i, r in enumerate(REFUSED)])
def test_two_forms_or_a_malformed_one_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        requested(_body(**fields))
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param)


MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "text", "jsonschema": {}}}, "response_format.jsonschema"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize(("fields", "loc"), MALFORMED, ids=[m[1] + str(i) for i, m in enumerate(MALFORMED)])
def test_the_forms_are_typed_fields(fields: dict[str, Any], loc: str) -> None:
    """Pydantic refuses these; the app's handler names the error's location as the param."""
    with pytest.raises(pydantic.ValidationError) as e:
        _body(**fields)
    where = [str(p) for p in e.value.errors()[0]["loc"]]
    assert ".".join(p for p in where if p in loc.split(".")) == loc


def test_the_openapi_schema_lists_the_forms() -> None:
    props = CompletionRequest.model_json_schema()["properties"]
    assert {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
            "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend"} <= set(props)
    chat = ChatCompletionRequest.model_json_schema()
    assert "ResponseFormat" in chat["$defs"] and "JsonSchemaFormat" in chat["$defs"]


UNCOMPILABLE: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "cannot be compiled"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "cannot be compiled"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "must not be empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": DEEP}, "guided_json", "nested too deeply"),
    # xgrammar leaves uniqueItems unenforced, llguidance does not implement it: refused
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs.json",
     "uniqueItems"),
]


@pytest.mark.parametrize(("fields", "param", "why"), UNCOMPILABLE,
                         ids=[u[1] + str(i) for i, u in enumerate(UNCOMPILABLE)])
def test_a_spec_no_backend_compiles_is_a_400_naming_its_field(fields: dict[str, Any], param: str,
                                                             why: str) -> None:
    constraint = requested(_body(**fields))
    assert constraint is not None
    with pytest.raises(OpenAIError) as e:
        BackendChoices().choose(constraint.params, "auto")
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(f"{param}: ") and why in e.value.message


def test_backend_choices_follow_the_preference_and_are_kept_per_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.router.api import structured

    calls: list[str] = []
    real = structured.choose_backend

    def counted(params: StructuredOutputsParams, preferred: str = "auto") -> StructuredOutputsParams:
        calls.append(preferred)
        return real(params, preferred)

    monkeypatch.setattr(structured, "choose_backend", counted)
    choices = BackendChoices(size=2)
    schema = StructuredOutputsParams(json=SCHEMA)
    assert choices.choose(schema, "auto").backend == "xgrammar"
    assert choices.choose(StructuredOutputsParams(json=SCHEMA), "auto").backend == "xgrammar"
    assert choices.choose(schema, "guidance").backend == "guidance"
    assert calls == ["auto", "guidance"]  # the second was kept
    # uniqueItems: xgrammar would not enforce it, so auto picks llguidance... which refuses it
    with pytest.raises(OpenAIError):
        choices.choose(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "auto")
    choices.choose(StructuredOutputsParams(regex="a"), "auto")  # evicts the oldest (json, auto)
    choices.choose(schema, "auto")
    assert calls[-1] == "auto" and len(calls) == 5


def test_the_wire_form_carries_the_routers_backend_and_the_worker_checks_it_again() -> None:
    chosen = BackendChoices().choose(StructuredOutputsParams(regex="[0-9]+"), "guidance")
    back = structured_from_proto(structured_to_proto(chosen) or pb.StructuredOutputs())
    assert back == chosen and back.backend == "guidance"
    bad = pb.StructuredOutputs(regex="[0-", backend="xgrammar")  # as a router would never send it
    with pytest.raises(ValueError, match=r"^structured_outputs: cannot be compiled"):
        structured_from_proto(bad)
    unchosen = structured_from_proto(pb.StructuredOutputs(regex="[0-"))  # the engine's Processor checks it
    assert unchosen.backend is None
    with pytest.raises(ValueError, match=r"^structured_outputs: nested too deeply"):
        structured_from_proto(pb.StructuredOutputs(json_schema=DEEP, backend="guidance"))
