"""The tool-call parsers find the same calls and content whatever the chunking of the text (whole,
character by character, random pieces), and the same as an independent reference written here
from the rules (a regex over the whole text for Hermes blocks, `json.JSONDecoder.raw_decode` over
the "required" array); streamed chat deltas reassemble into the non-streamed message."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from services.router.api.tool_parser import (
    CallArguments,
    CallStart,
    Content,
    Event,
    HermesParser,
    NamedParser,
    RequiredParser,
    ToolParser,
)
from services.router.api.tools import ChoiceCalls, ToolPlan

Calls = list[tuple[str, str]]  # (name, arguments)


def _call(name: str, args: Any, pad: str = "\n") -> str:
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}</tool_call>"


HERMES_TEXTS = {
    "plain": "Paris is the capital of France.\n",
    "one call": _call("get_weather", {"city": "Paris"}),
    "two calls": _call("get_weather", {"city": "Paris"}) + "\n" + _call("get_time", {"tz": "CET"}) + "\n",
    "content before": "Let me check.\n" + _call("get_weather", {"city": "Paris"}),
    "content before and after": "Let me check.\n" + _call("f", {}) + "\nDone. <b>ok</b> <tool",
    "between calls": _call("f", {"a": 1}) + " and then " + _call("g", {"b": [1, 2]}, pad=""),
    "content around two calls": "A\n" + _call("f", {}) + "\n" + _call("g", {}) + " B",
    "no arguments key": '<tool_call>{"name": "now"}</tool_call>',
    "malformed json": "Hi <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call> bye",
    "not a call": '<tool_call>{"arguments": {}}</tool_call><tool_call>[1, 2]</tool_call>',
    "malformed then call": "x\n<tool_call>oops</tool_call>\n" + _call("f", {"q": "</x>"}) + " y",
    "partial tag at the end": "The answer is 4. <tool_ca",
    "partial end tag": "<tool_call>\n" + json.dumps({"name": "f", "arguments": {"x": 1}}) + "\n</tool_",
    "unclosed valid": "<tool_call>\n" + json.dumps({"name": "f", "arguments": {"x": "é"}}),
    "unclosed invalid": "ok <tool_call>\n{\"name\": \"f\", \"argu",
    "unicode and escapes": _call("say", {"text": "héllo \"world\" \\ </b>"}),
    "whitespace only around calls": "  \n" + _call("f", {}) + "\n\n",
    "tag-like text": "a < b and <tool> and </tool_call> stay",
}


def _hermes_reference(text: str) -> tuple[str, Calls]:
    """The Hermes rules over the whole text: blocks by regex (an unclosed one at the end too); a
    call's surrounding whitespace goes with it; content on both sides of calls is joined by the
    whitespace before the first of them."""
    parts: list[str | tuple[str, str]] = []
    pos = 0
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", text, re.S):
        parts.append(text[pos:m.start()])
        block = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            obj = json.loads(block)
        except ValueError:
            obj = None
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str)
        parts.append((obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)) if ok
                     else m.group(0))
        pos = m.end()
    parts.append(text[pos:])
    merged: list[str | tuple[str, str]] = []
    for part in parts:  # malformed blocks are text: join them with their neighbours
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    content, calls, said, sep = "", [], False, ""
    for i, part in enumerate(merged):
        if isinstance(part, tuple):
            calls.append(part)
            continue
        if i > 0 and isinstance(merged[i - 1], tuple):
            part = part.lstrip()
        before_call = i + 1 < len(merged) and isinstance(merged[i + 1], tuple)
        core = part.rstrip() if before_call else part
        if core:
            content += (sep if said else "") + core
            said, sep = True, ""
        if before_call:
            sep = sep or part[len(core):]
    return content, calls


def _required_reference(text: str) -> tuple[str, Calls]:
    """A JSON array of {"name", "parameters"}: its whole elements are calls, the rest content."""
    decoder = json.JSONDecoder()
    calls: Calls = []
    pos = len(text) - len(text.lstrip())
    if not text[pos:].startswith("["):
        return (text if text.strip() else ""), calls
    pos += 1
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        if text[pos:pos + 1] == "]":
            rest = text[pos + 1:]
            return (rest if rest.strip() else ""), calls
        try:
            element, end = decoder.raw_decode(text, pos)
        except ValueError:
            return (text[pos:] if text[pos:].strip() else ""), calls
        calls.append((element["name"], json.dumps(element["parameters"], ensure_ascii=False)))
        pos = end


def _run(parser: ToolParser, pieces: list[str]) -> list[Event]:
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def _summary(events: list[Event]) -> tuple[str, Calls]:
    """Content and calls (name, concatenated arguments), checking each call's events are in order."""
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append((e.name, ""))
        else:
            assert isinstance(e, CallArguments) and e.index == len(calls) - 1
            calls[-1] = (calls[-1][0], calls[-1][1] + e.text)
    return content, calls


def _chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize("name", list(HERMES_TEXTS))
def test_hermes_finds_the_reference_calls_and_content_whatever_the_chunking(name: str) -> None:
    text = HERMES_TEXTS[name]
    expected = _hermes_reference(text)
    for pieces in _chunkings(text, seed=len(text)):
        assert _summary(_run(HermesParser(), pieces)) == expected, pieces


def test_hermes_examples_read_as_a_person_would() -> None:
    """The reference itself, on the cases that matter most."""
    assert _hermes_reference(HERMES_TEXTS["content before and after"]) == (
        "Let me check.\nDone. <b>ok</b> <tool", [("f", "{}")])
    assert _hermes_reference(HERMES_TEXTS["two calls"]) == (
        "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')])
    assert _hermes_reference(HERMES_TEXTS["content around two calls"])[0] == "A\nB"
    assert _hermes_reference(HERMES_TEXTS["malformed json"])[1] == []
    assert _hermes_reference(HERMES_TEXTS["unclosed valid"]) == ("", [("f", '{"x": "é"}')])


def test_hermes_holds_back_what_may_begin_a_block_and_nothing_else() -> None:
    parser = HermesParser()
    assert parser.feed("Sure, let me look that up. <tool_") == [Content("Sure, let me look that up.")]
    assert parser.feed("call>\n{\"name\": \"f\", ") == []  # inside a block: it goes out whole
    assert parser.feed('"arguments": {"k": 2}}\n</tool_call>') == [CallStart(0, "f"),
                                                                    CallArguments(0, '{"k": 2}')]
    assert parser.feed("\n<") == []
    assert parser.feed("b>") == [Content(" <b>")]  # the separator before the call, then the text
    assert parser.finish() == []


REQUIRED_TEXTS = {
    "one": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    "two with whitespace": ' [\n  {"name": "f", "parameters": {"a": "x}]\\"{"}} ,\n {"name": "g", '
                           '"parameters": {}}\n]\n',
    "nested": '[{"name": "f", "parameters": {"list": [{"a": [1, {"b": "]"}]}], "n": null}}]',
    "cut short in the second": '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parame',
    "cut short in the first": '[{"name": "f", "param',
    "unicode": '[{"name": "f", "parameters": {"t": "日本"}}]',
}


@pytest.mark.parametrize("name", list(REQUIRED_TEXTS))
def test_required_finds_the_reference_calls_whatever_the_chunking(name: str) -> None:
    text = REQUIRED_TEXTS[name]
    expected = _required_reference(text)
    for pieces in _chunkings(text, seed=len(text)):
        assert _summary(_run(RequiredParser(), pieces)) == expected, pieces


def test_required_gives_each_call_as_soon_as_its_element_closes() -> None:
    parser = RequiredParser()
    assert parser.feed('[{"name": "f", "parameters": {"a": 1}') == []
    assert parser.feed('}, {"name"') == [CallStart(0, "f"), CallArguments(0, '{"a": 1}')]
    assert parser.feed(': "g", "parameters": {}}]') == [CallStart(1, "g"), CallArguments(1, "{}")]
    assert parser.finish() == []


def test_named_streams_the_text_as_the_arguments() -> None:
    text = '{"city": "Paris", "unit": "c"}'
    for pieces in _chunkings(text, seed=1):
        assert _summary(_run(NamedParser("get_weather"), pieces)) == ("", [("get_weather", text)])
    assert _run(NamedParser("f"), []) == [CallStart(0, "f")]


PLANS = {"auto": ToolPlan("auto"), "required": ToolPlan("required"), "named": ToolPlan("named", "f"),
         "auto-single": ToolPlan("auto", parallel=False)}
SAMPLES = {"auto": HERMES_TEXTS["content before and after"] + _call("g", {"x": [1]}),
           "required": REQUIRED_TEXTS["two with whitespace"], "named": '{"a": [1, 2]}',
           "auto-single": HERMES_TEXTS["two calls"]}


@pytest.mark.parametrize("mode", list(PLANS))
def test_streamed_deltas_reassemble_into_the_message(mode: str) -> None:
    """The openai client's way: content concatenated, each call's fields by its index."""
    plan, text = PLANS[mode], SAMPLES[mode]
    whole = ChoiceCalls(plan)
    content, calls = whole.message(text)
    for pieces in _chunkings(text, seed=7):
        stream = ChoiceCalls(plan)
        deltas = [d for k, piece in enumerate(pieces) for d in stream.deltas(piece, k == len(pieces) - 1)]
        got_content, got_calls = "", {}
        for d in deltas:
            got_content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:  # a call's first chunk: id, type, name, no arguments yet
                    assert c["id"].startswith("chatcmpl-tool-") and c["function"]["arguments"] == ""
                    got_calls[c["index"]] = {"type": c["type"], "function": dict(c["function"])}
                else:
                    got_calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        assert got_content == (content or "")
        assert list(got_calls.values()) == [{k: c[k] for k in ("type", "function")} for c in calls]
        assert stream.called == whole.called == bool(calls)
    if mode == "auto-single":
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert content is None if mode != "auto" else content == "Let me check.\nDone. <b>ok</b> <tool"


def test_finish_reason_is_tool_calls_except_for_a_named_function() -> None:
    """As OpenAI and vLLM: "tool_calls" when auto or required calls ended the sample."""
    assert ToolPlan("auto").finish_reason("stop", called=True) == "tool_calls"
    assert ToolPlan("auto").finish_reason("stop", called=False) == "stop"
    assert ToolPlan("required").finish_reason("stop", called=True) == "tool_calls"
    assert ToolPlan("required").finish_reason("length", called=True) == "length"
    assert ToolPlan("named", "f").finish_reason("stop", called=True) == "stop"
