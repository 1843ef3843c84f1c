"""What a chat request's tools ask of the router (services/router/api/tools.py): the grammar of
tool_choice "required" (vLLM's array of {name, parameters}, checked here with jsonschema) and of a
named function; the request errors, each naming its field; and the flags that turn tools on
(the router's, as vLLM's, and what `pdserve up` passes)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema
import pytest

from engine.structured.params import StructuredOutputsParams
from services.router.api.openai_models import ChatCompletionRequest
from services.router.api.tools import ToolPlan, constrain, tool_plan
from services.router.config import RouterConfig
from services.router.errors import OpenAIError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                             "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _plan(auto_tools: bool = True, **body: Any) -> ToolPlan:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return tool_plan(request, auto_tools)


def _schema(plan: ToolPlan) -> dict[str, Any]:
    assert plan.constraint is not None and plan.constraint.source == "tool_choice"
    assert plan.constraint.backend in ("xgrammar", "guidance")  # it compiles
    schema = plan.constraint.schema()
    assert schema is not None
    return schema


def test_required_is_an_array_of_one_or_more_calls_of_the_offered_tools() -> None:
    schema = _schema(_plan(tools=TOOLS, tool_choice="required"))
    ok = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}],
          [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}]]
    bad = [[], [{"name": "get_date", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
           [{"name": "get_weather", "parameters": {"city": "x", "unit": "k"}}], [{"name": "get_time"}],
           [{"name": "get_time", "parameters": {}, "extra": 1}], {"name": "get_time", "parameters": {}}]
    for instance in ok:
        jsonschema.validate(instance, schema)
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)


def test_parallel_tool_calls_false_allows_one_call() -> None:
    schema = _schema(_plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    two = [{"name": "get_time", "parameters": {}}] * 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(two, schema)
    assert not _plan(tools=TOOLS, parallel_tool_calls=False).parallel


def test_a_named_function_is_its_arguments_object() -> None:
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.choice, named.name, _schema(named)) == ("named", "get_weather", WEATHER)
    bare = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    jsonschema.validate({}, _schema(bare))


def test_defs_of_every_tool_move_to_the_root_where_their_refs_point() -> None:
    with_defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
                 "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                     "required": ["x"]}}}
    tools = [{"type": "function", "function": {"name": "move", "parameters": with_defs}}, TOOLS[1]]
    schema = _schema(_plan(tools=tools, tool_choice="required"))
    jsonschema.validate([{"name": "move", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"p": {"x": "1"}}}], schema)
    assert tools[0]["function"]["parameters"] == with_defs  # the request's own schema is untouched
    other = json.loads(json.dumps(tools))
    other[1]["function"]["parameters"] = {"type": "object", "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(OpenAIError) as e:
        _plan(tools=other, tool_choice="required")
    assert e.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize(("body", "auto_tools", "choice"), [
    ({}, False, "none"),
    ({"tools": TOOLS, "tool_choice": "none"}, False, "none"),  # tools still listed in the prompt
    ({"tool_choice": "auto"}, False, "none"),  # nothing to call
    ({"tools": [], "tool_choice": "auto"}, True, "none"),
    ({"tools": TOOLS}, True, "auto"),  # auto: the default with tools
])
def test_what_asks_for_no_grammar(body: dict[str, Any], auto_tools: bool, choice: str) -> None:
    plan = _plan(auto_tools, **body)
    assert (plan.choice, plan.constraint) == (choice, None)
    assert len(plan.template_tools) == len(body.get("tools") or [])


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters", "invalid JSON schema"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]},
     "tools[1].function.parameters", "cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "offers none"),
    ({"tool_choice": "required"}, "tool_choice", "offers none"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "offers none"),
])
def test_bad_tools_are_400s_naming_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(OpenAIError) as e:
        _plan(**body)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_one_grammar_per_sample_required_beside_response_format_is_a_400() -> None:
    fields: dict[str, Any] = {"structured_outputs": None}
    plan = _plan(tools=TOOLS, tool_choice="required")
    constrain(fields, plan)
    assert fields["structured_outputs"] is plan.constraint
    other = StructuredOutputsParams(json_object=True, source="response_format")
    with pytest.raises(OpenAIError) as e:
        constrain({"structured_outputs": other}, plan)
    assert e.value.param == "tool_choice" and "response_format" in e.value.message
    untouched = {"structured_outputs": other}
    constrain(untouched, _plan(tools=TOOLS, tool_choice="none"))  # no grammar of its own: fine
    assert untouched["structured_outputs"] is other


def test_auto_needs_the_routers_auto_tool_choice_as_in_vllm() -> None:
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(OpenAIError) as e:
            _plan(auto_tools=False, **body)
        assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    assert _plan(auto_tools=False, tools=TOOLS, tool_choice="required").choice == "required"


def test_router_flags_are_checked_as_vllm_checks_them(tmp_path: Any) -> None:
    base = {"model": "m", "tokenizer": "m"}
    assert RouterConfig(**base, tool_call_parser="hermes", enable_auto_tool_choice=True).auto_tools
    assert not RouterConfig(**base, tool_call_parser="hermes").auto_tools
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        RouterConfig(**base, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        RouterConfig(**base, tool_call_parser="pythonic")  # not one of ours
    with pytest.raises(ValueError, match="hermes_tools"):  # the message lists the shipped ones
        RouterConfig(**base, chat_template=str(tmp_path / "missing.jinja"))
    own = tmp_path / "t.jinja"
    own.write_text("{{ messages }}")
    assert RouterConfig(**base, chat_template=str(own)).chat_template == str(own)
    assert RouterConfig(**base, chat_template="hermes_tools").chat_template == "hermes_tools"


@pytest.mark.parametrize(("model", "template", "expected"), [
    ("smollm2-135m-instruct", None, ["--chat-template", "hermes_tools"]),
    ("/models/qwen2.5", None, []),  # another model keeps its own template
    ("smollm2-135m-instruct", "", []),  # '' asks for the tokenizer's own
    ("/models/qwen2.5", "/t/x.jinja", ["--chat-template", "/t/x.jinja"]),
])
def test_up_starts_the_router_with_tools_on(model: str, template: str | None, expected: list[str]) -> None:
    from services.up.specs import tool_args

    args = argparse.Namespace(model=model, chat_template=template)
    # a folder without config.json (or a Qwen one): Hermes, the format of the default's template
    assert tool_args(args, model) == [*expected, "--tool-call-parser", "hermes",
                                       "--enable-auto-tool-choice"]
