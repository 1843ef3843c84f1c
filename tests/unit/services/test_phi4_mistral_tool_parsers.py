"""vLLM's phi4_mini_json format (`functools[...]`) and Mistral's v11 form
(`[TOOL_CALLS]name[ARGS]{...}`): calls and content found from the text alone, the same events
whatever the text's cutting; malformed or cut-short replies are content; the parser is chosen by
--tool-call-parser and by `pdserve up` for the model's family."""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import pytest

from services.router.api.json_tool_parsers import MistralParser, Phi4MiniJsonParser
from services.router.api.tool_parser import CallArguments, CallStart, Content, Event
from services.router.api.tools import TOOL_CALL_PARSERS, ChoiceCalls, ToolPlan
from tests.unit.services.test_json_tool_parsers import _cuttings, _run

Parser = type[MistralParser] | type[Phi4MiniJsonParser]
Calls = list[tuple[str, dict[str, Any]]]

CITY = {"city": "Paris", "unit": "c"}
MISTRAL: list[tuple[str, str, Calls]] = [  # text -> content, calls
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}', "", [("get_weather", CITY)]),
    ('Let me check.[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"q": "[TOOL_CALLS]x{y}"}', "Let me check.",
     [("a", {}), ("b", {"q": "[TOOL_CALLS]x{y}"})]),
    ('[TOOL_CALLS]a{"x": [1, {"y": null}]}', "", [("a", {"x": [1, {"y": None}]})]),  # [ARGS] left out
    ('[TOOL_CALLS]a[CALL_ID]Ab3dE5gH9[ARGS]{"x": 1}', "", [("a", {"x": 1})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}\n[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Zurich"}\n',
     "", [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "Europe/Zurich"})]),
    ("[TOOL_CALLS]a[ARGS]{} and more", " and more", [("a", {})]),
    # malformed or cut short: content, as written
    ("[TOOL_CALLS]I cannot {do that}", "[TOOL_CALLS]I cannot {do that}", []),
    ('[TOOL_CALLS]a[ARGS]{"cut": "sho', '[TOOL_CALLS]a[ARGS]{"cut": "sho', []),
    ("Hm.[TOOL_CALLS]get_wea", "Hm.[TOOL_CALLS]get_wea", []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),  # no name
    ("[TOOL_CALLS]" + "x" * 300 + "{}", "[TOOL_CALLS]" + "x" * 300 + "{}", []),  # no name that long
    ("[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{\"x\": ", "[TOOL_CALLS]b[ARGS]{\"x\": ", [("a", {})]),
    ("[TOOL_CALLS]a[ARGS]{}[TOOL_", "[TOOL_", [("a", {})]),
    # the JSON-array form is still read
    ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}]', "", [("a", {"x": 1})]),
]
PHI4: list[tuple[str, str, Calls]] = [
    ('functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', "",
     [("get_weather", CITY)]),
    ('functools[\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n'
     '  {"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}\n]', "",
     [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    ('functools[{"name": "a", "arguments": {"l": [1, [2]], "s": "]", "e": {}}}]', "",
     [("a", {"l": [1, [2]], "s": "]", "e": {}})]),  # brackets inside (vLLM's regex stops at the first)
    ('Let me check.\nfunctools[{"name": "a", "arguments": {}}]\nAnything else?',
     "Let me check.\n\nAnything else?", [("a", {})]),
    ('<|tool_call|>functools[{"name": "a", "arguments": {"q": "é"}}]<|/tool_call|>', "",
     [("a", {"q": "é"})]),
    ('Sure. <|tool_call|> functools[{"name": "a", "arguments": {}}] <|/tool_call|>', "Sure. ", [("a", {})]),
    ("Python's functools module is handy.", "Python's functools module is handy.", []),
    ("<|tool_call|>oops", "<|tool_call|>oops", []),
    # the model's own form: <|tool_call|>, an array or objects between commas, <|/tool_call|>
    ('<|tool_call|>[{"name": "a", "arguments": {"x": 1}}]<|/tool_call|>', "", [("a", {"x": 1})]),
    ('<|tool_call|>{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}<|/tool_call|>', "",
     [("a", {}), ("b", {"y": 2})]),
    ('Text <|tool_call|>[{"name": "a", "arguments": {}}]', "Text ", [("a", {})]),  # no closing tag
    ('<|tool_call|> x <|tool_call|>\n[{"name": "a", "arguments": {}}]', "<|tool_call|> x ", [("a", {})]),
    ('<|tool_call|>[{"name": "a"}]<|/tool_call|>', '<|tool_call|>[{"name": "a"}]<|/tool_call|>', []),
    ('functools[{"name": "a", "arguments": {}}, {"oops": 1}]', ', {"oops": 1}]', [("a", {})]),
]
# vLLM's test_phi4mini_tool_parser malformed inputs: content, as written (never an exception)
PHI4_MALFORMED = ['functools[{"name": "func", "arguments": {',
                  'functools[{"name": "func", "arguments": "not a dict"}]', 'functools{"name": "func"}',
                  'functools[{"name": "func"}]', "functools[] This is just text",
                  "functools[ This is just text ]", "<|tool_call|>functools[", "functools"]
CASES = [(MistralParser, *c) for c in MISTRAL] + [(Phi4MiniJsonParser, *c) for c in PHI4] + \
        [(Phi4MiniJsonParser, t, t, []) for t in PHI4_MALFORMED]


def _events(parser_type: Parser, pieces: list[str]) -> list[Event]:
    """The events of a reply fed in these pieces, with neighbouring text joined."""
    parser = parser_type()
    out: list[Event] = []
    for e in [e for piece in pieces for e in parser.feed(piece)] + parser.finish():
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + e.text)
        elif isinstance(e, CallArguments) and isinstance(last, CallArguments) and last.index == e.index:
            out[-1] = CallArguments(e.index, last.text + e.text)
        elif not isinstance(e, Content) or e.text:
            out.append(e)
    return out


@pytest.mark.parametrize(("parser_type", "text", "content", "calls"), CASES)
def test_calls_and_content_whatever_the_cutting(parser_type: Parser, text: str, content: str,
                                                calls: Calls) -> None:
    whole = _events(parser_type, [text])
    assert _run(parser_type, [text]) == (content, calls)
    starts = [e for e in whole if isinstance(e, CallStart)]
    assert [e.index for e in starts] == list(range(len(calls)))
    for e in whole:  # arguments as json.dumps writes them
        if isinstance(e, CallArguments):
            assert e.text == json.dumps(json.loads(e.text), ensure_ascii=False)
    cuttings = _cuttings(text) + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in cuttings:
        assert _events(parser_type, pieces) == whole, pieces


@pytest.mark.parametrize("parser_type", [MistralParser, Phi4MiniJsonParser])
def test_random_replies_never_raise_and_do_not_depend_on_the_cutting(parser_type: Parser) -> None:
    """Replies made of the formats' pieces at random: the same events however they are cut, and
    a reply without calls is its text, as written."""
    pieces = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "functools[", "<|tool_call|>", "<|/tool_call|>", "{",
              "}", "[", "]", '"name"', ": ", '"a"', ", ", '"arguments"', '"parameters"', "{}", " ", "\n", "x"]
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
        whole = _events(parser_type, [text])
        if not any(isinstance(e, CallStart) for e in whole):
            assert whole == ([Content(text)] if text else []), text
        for _ in range(3):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
            cut = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert _events(parser_type, cut) == whole, cut


def test_a_call_goes_out_as_soon_as_it_is_complete() -> None:
    parser = MistralParser()
    assert parser.feed("Sure.[TOOL_") == [Content("Sure.")]
    assert parser.feed('CALLS]a[ARGS]{"x": 1') == []
    assert parser.feed("}[TOOL_CALLS]b") == [CallStart(0, "a"), CallArguments(0, '{"x": 1}')]
    assert parser.feed("[ARGS]{}") == [CallStart(1, "b"), CallArguments(1, "{}")]
    assert parser.finish() == []
    parser = Phi4MiniJsonParser()
    assert parser.feed("Ok. functo") == [Content("Ok. ")]
    assert parser.feed('ols[{"name": "a", "arguments": {}}') == [CallStart(0, "a"), CallArguments(0, "{}")]
    assert parser.feed("]") == []
    assert parser.finish() == []


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), [
    ("phi4_mini_json", PHI4[1][0], None, PHI4[1][2]),
    ("mistral", "Checking." + MISTRAL[4][0], "Checking.", MISTRAL[4][2]),
])
def test_a_choice_reply_streamed_and_not(parser_name: str, text: str, content: str | None,
                                         calls: Calls) -> None:
    """Through the router's ChoiceCalls: ids, indices and finish_reason as for the other parsers;
    the streamed deltas put together equal the non-streamed message."""
    plan = ToolPlan("auto", parser_name=parser_name)
    whole = ChoiceCalls(plan)
    got_content, got_calls = whole.message(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)
    assert plan.finish_reason("stop", whole.called) == "tool_calls"
    streamed = ChoiceCalls(plan)
    deltas = [d for i in range(0, len(text), 3) for d in streamed.deltas(text[i:i + 3], False)]
    deltas += streamed.deltas("", True)
    joined: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                joined[c["index"]] = [c["function"]["name"], ""]
            joined[c["index"]][1] += c["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in joined.values()] == calls
    assert [a for _, a in joined.values()] == [c["function"]["arguments"] for c in got_calls]
    assert ("".join(d.get("content", "") for d in deltas) or None) == content
    assert plan.keeps_special_tokens == (parser_name == "mistral")  # [TOOL_CALLS] is a special token


def test_the_parser_is_chosen_by_name_and_by_the_flags() -> None:
    from services.cli import build_parser
    from services.router.config import RouterConfig

    assert "phi4_mini_json" in TOOL_CALL_PARSERS
    assert isinstance(ToolPlan("auto", parser_name="phi4_mini_json").parser(), Phi4MiniJsonParser)
    assert isinstance(ToolPlan("auto", parser_name="mistral").parser(), MistralParser)
    assert RouterConfig(model="m", tokenizer="m", tool_call_parser="phi4_mini_json",
                        enable_auto_tool_choice=True).auto_tools
    parser, router = build_parser(), ["router", "--model", "m", "--decode", "d:1"]
    for name in TOOL_CALL_PARSERS:  # the CLI's choices are the router's parsers
        assert parser.parse_args([*router, "--tool-call-parser", name]).tool_call_parser == name
        assert parser.parse_args(["up", "--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args([*router, "--tool-call-parser", "pythonic"])


@pytest.mark.parametrize(("arch", "parser"), [("Phi3ForCausalLM", "phi4_mini_json"),
                                              ("Mistral3ForConditionalGeneration", "mistral")])
def test_pdserve_up_picks_the_model_familys_parser(tmp_path, arch: str, parser: str) -> None:
    from services.up.specs import default_tool_parser, tool_args

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    assert default_tool_parser("microsoft/Phi-4-mini-instruct", str(tmp_path)) == parser
    up = argparse.Namespace(model="my-model", chat_template=None, tool_call_parser=None)
    assert tool_args(up, str(tmp_path))[-3:] == ["--tool-call-parser", parser, "--enable-auto-tool-choice"]
