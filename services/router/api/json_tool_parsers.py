"""Tool calls written as bare JSON, as vLLM's `llama3_json`, `mistral` and `phi4_mini_json`
parsers read them (the Hermes tags and the event protocol: tool_parser.py).

- `llama3_json` (Llama 3.1 / 3.2 / 3.3): a reply that starts (after whitespace) with `{` or with
  `<|python_tag|>` is calls: JSON objects `{"name": ..., "parameters": {...}}` ("arguments" is
  taken too) separated by `;`. Any other reply is content.
- `mistral`: content, then `[TOOL_CALLS]` and the calls in one of two forms, told apart by what
  follows the tag (vLLM tells them apart by the tokenizer's version; the text says the same):
  a JSON array of `{"name": ..., "arguments": {...}}` (tokenizers before v11: Mistral 7B v0.3,
  Mixtral, Mistral NeMo), or `name[ARGS]{arguments}` with a `[TOOL_CALLS]` before each call
  (v11 and later: Mistral Small 3.1 / 3.2, Magistral, Devstral; a `[CALL_ID]id` before
  `[ARGS]` is passed over, and so is a missing `[ARGS]`). The tags are special tokens: the router
  keeps special tokens in the text of requests parsed this way (as vLLM's mistral parser does).
- `phi4_mini_json` (Phi-4-mini): content, then `functools[` and the rest of a JSON array of
  `{"name": ..., "arguments": {...}}` ("parameters" is taken too), as vLLM's template asks for;
  or, in the model's own form, `<|tool_call|>`, such an array (or such objects between commas)
  and `<|/tool_call|>` (the tags are dropped; they show where they are not special tokens, or
  where the request keeps special tokens).

Each call goes out once its JSON object is complete, its arguments as `json.dumps` writes them.
Whatever does not form a call (not an object with a string `name`, text after the calls, a
reply cut short) goes out as content at the end, as written. The events depend only on the text,
not on how it was cut into pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol

from services.router.api.tool_parser import CallArguments, CallStart, Content, Event

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
PHI4_MARK, PHI4_OPEN, PHI4_CLOSE = "functools[", "<|tool_call|>", "<|/tool_call|>"
_DECODER = json.JSONDecoder()
# Between a v11 `[TOOL_CALLS]` and the arguments' `{`: the name, a call id, `[ARGS]`.
_MISTRAL_HEAD = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[^\s\[\]{}]+\s*)?(?:\[ARGS\]\s*)?")
_MISTRAL_HEAD_MAX = 256  # longer, it is no name (and the text is not scanned for a `{` forever)

CallOf = Callable[[Any], tuple[str, str] | None]


def _call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _phi4_call(obj: Any) -> tuple[str, str] | None:
    """vLLM's phi4_mini_json reads "arguments", else "parameters"; here they must be an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _calls_events(index: int, call: tuple[str, str]) -> list[Event]:
    return [CallStart(index, call[0]), CallArguments(index, call[1])]


class _Calls(Protocol):
    calls: int

    def feed(self, text: str) -> list[Event]: ...

    def rest(self) -> str: ...


class _CallsText:
    """A reply's calls part as it arrives: the text, how far the calls used it, and whether
    they ended (what follows is content)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # used up to here
        self.closed = False
        self.calls = 0

    def rest(self) -> str:
        """What never formed a call: content."""
        text = self.text[self.pos:]
        return text if text.strip() else ""


class _JsonCalls(_CallsText):
    """The calls part: objects one after another, between `separators`, optionally inside one
    array (`array=True`). Keeps the text it could not use for the end."""

    def __init__(self, array: bool, separators: str, call: CallOf = _call) -> None:
        super().__init__()
        self.array, self.separators, self.call = array, separators, call
        self.opened = not array  # the array's "[" was seen; closed: its "]" (or a non-call)

    def feed(self, text: str) -> list[Event]:
        self.text += text
        events: list[Event] = []
        while not self.closed:
            rest = self.text[self.pos:]
            stripped = rest.lstrip(self.separators + " \t\r\n" if self.opened else " \t\r\n")
            skip = len(rest) - len(stripped)
            if not stripped:
                return events
            if not self.opened:
                if stripped[0] != "[":
                    self.closed = True
                    return events
                self.opened, self.pos = True, self.pos + skip + 1
                continue
            if self.array and stripped[0] == "]":
                self.pos, self.closed = self.pos + skip + 1, True
                return events
            if stripped[0] != "{":
                self.closed = True
                return events
            try:
                obj, end = _DECODER.raw_decode(stripped)
            except ValueError:
                return events  # not complete yet (or never: content at the end)
            call = self.call(obj)
            if call is None:
                self.closed = True
                return events
            self.pos += skip + end
            events += _calls_events(self.calls, call)
            self.calls += 1
        return events


class _MistralNamedCalls(_CallsText):
    """Mistral's v11 form: `[TOOL_CALLS]name[ARGS]{...}`, again for each call, from the first
    tag on. A call whose name or arguments do not parse ends the calls: it and what follows are
    content (vLLM's returns such a call with its arguments as written). `pos`: where the next
    call's tag (or the whitespace before it) starts."""

    def feed(self, text: str) -> list[Event]:
        self.text += text
        events: list[Event] = []
        while not self.closed:
            rest = self.text[self.pos:]
            stripped = rest.lstrip()
            if not stripped.startswith(MISTRAL_TAG):
                self.closed = not MISTRAL_TAG.startswith(stripped)  # else it may be the tag: wait
                return events
            start = self.pos + len(rest) - len(stripped) + len(MISTRAL_TAG)
            brace = self.text.find("{", start, start + _MISTRAL_HEAD_MAX + 1)
            if brace < 0:
                self.closed = len(self.text) - start > _MISTRAL_HEAD_MAX
                return events
            head = _MISTRAL_HEAD.fullmatch(self.text, start, brace)
            if head is None:
                self.closed = True
                return events
            try:
                obj, end = _DECODER.raw_decode(self.text, brace)
            except ValueError:
                return events  # not complete yet (or never: content at the end)
            self.pos = end
            events += _calls_events(self.calls, (head[1], json.dumps(obj, ensure_ascii=False)))
            self.calls += 1
        return events


class Llama3JsonParser:
    """vLLM's `llama3_json`: calls when the reply starts with `{` or `<|python_tag|>`."""

    def __init__(self) -> None:
        self._head = ""  # the reply's start, until it shows what it is
        self._all = ""  # the whole reply, as written
        self._calls: _JsonCalls | None = None
        self._content = False

    def feed(self, text: str) -> list[Event]:
        self._all += text
        if self._content:
            return [Content(text)] if text else []
        if self._calls is not None:
            return self._calls.feed(text)
        self._head += text
        head = self._head.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []  # whitespace, or maybe the tag's first characters
        body = head.removeprefix(PYTHON_TAG)
        if head.startswith(PYTHON_TAG) or head.startswith("{"):
            self._calls = _JsonCalls(array=False, separators=";")
            return self._calls.feed(body)
        self._content = True
        return [Content(self._head)]

    def finish(self) -> list[Event]:
        if self._calls is not None:
            rest = self._calls.rest()
            if self._calls.calls == 0:  # not calls after all: the reply as written
                return [Content(self._all)] if self._all.strip() else []
            return [Content(rest)] if rest else []
        if not self._content and self._head:
            return [Content(self._head)]
        return []


class MistralParser:
    """vLLM's `mistral`: content, then `[TOOL_CALLS]` and the calls, as a JSON array (`[` after
    the tag) or in the v11 form `name[ARGS]{...}`, a tag before each."""

    def __init__(self) -> None:
        self._text = ""  # content not yet sent (it may hold the tag's first characters)
        self._calls: _Calls | None = None
        self._tail = ""  # the tag and what follows, as written

    def feed(self, text: str) -> list[Event]:
        if self._tail:
            self._tail += text
            return self._form() if self._calls is None else self._calls.feed(text)
        self._text += text
        at = self._text.find(MISTRAL_TAG)
        if at < 0:
            events, self._text = _send(self._text, _tag_prefix(self._text, MISTRAL_TAG))
            return events
        before, self._tail, self._text = self._text[:at], self._text[at:], ""
        return [*([Content(before)] if before else []), *self._form()]

    def _form(self) -> list[Event]:
        """The calls' form, once the first character after the tag shows it."""
        after = self._tail[len(MISTRAL_TAG):]
        if not after.strip():
            return []
        if after.lstrip()[0] == "[":
            self._calls = _JsonCalls(array=True, separators=",")
            return self._calls.feed(after)
        self._calls = _MistralNamedCalls()
        return self._calls.feed(self._tail)

    def finish(self) -> list[Event]:
        return _finish(self._text, self._tail, self._calls)


class Phi4MiniJsonParser:
    """vLLM's `phi4_mini_json`: content, then `functools[{...}, ...]`. Phi-4-mini's own form is
    read too: `<|tool_call|>`, the calls' JSON array (or objects between commas), `<|/tool_call|>`
    (the tags are dropped). vLLM's drops the content around the calls and parses the array only
    up to its first `]`; here the content stays and the array is read whole."""

    def __init__(self) -> None:
        self._text = ""  # content not yet sent (it may hold the calls' first characters)
        self._calls: _JsonCalls | None = None
        self._tail = ""  # the calls (with their <|tool_call|>) and what follows, as written

    def feed(self, text: str) -> list[Event]:
        if self._calls is not None:
            self._tail += text
            return self._calls.feed(text)
        self._text += text
        found = _phi4_start(self._text)
        if isinstance(found, int):
            events, self._text = _send(self._text, found)
            return events
        start, json_at = found
        before, self._tail, calls = self._text[:start], self._text[start:], self._text[json_at:]
        self._text = ""
        self._calls = _JsonCalls(array=calls[0] == "[", separators=",", call=_phi4_call)
        return [*([Content(before)] if before else []), *self._calls.feed(calls)]

    def finish(self) -> list[Event]:
        if self._calls is not None and self._calls.calls:
            rest = self._calls.rest()
            if rest.lstrip().startswith(PHI4_CLOSE):
                rest = rest.lstrip()[len(PHI4_CLOSE):]
            return [Content(rest)] if rest.strip() else []
        return _finish(self._text, self._tail, self._calls)


def _phi4_start(text: str) -> tuple[int, int] | int:
    """Where Phi-4-mini's calls begin in `text`: (their start, a `<|tool_call|>` included, and
    their JSON's); else how many characters at its end may begin them."""
    pos = 0
    while True:
        mark, tag = text.find(PHI4_MARK, pos), text.find(PHI4_OPEN, pos)
        if tag < 0 or 0 <= mark < tag:
            if mark >= 0:
                return mark, mark + len(PHI4_MARK) - 1  # from its "["
            return max(_tag_prefix(text, PHI4_MARK), _tag_prefix(text, PHI4_OPEN))
        body = text[tag + len(PHI4_OPEN):].lstrip()
        if body.startswith(PHI4_MARK):
            return tag, len(text) - len(body) + len(PHI4_MARK) - 1
        if body[:1] in ("[", "{"):
            return tag, len(text) - len(body)
        if PHI4_MARK.startswith(body):
            return len(text) - tag  # whitespace or the marker's start: wait
        pos = tag + len(PHI4_OPEN)  # this tag begins no calls: content


def _send(text: str, keep: int) -> tuple[list[Event], str]:
    """The content of `text` but its last `keep` characters (a tag may begin there), and those."""
    out, kept = text[:len(text) - keep], text[len(text) - keep:]
    return [Content(out)] if out else [], kept


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    return next(k for k in range(min(len(tag) - 1, len(text)), -1, -1) if text.endswith(tag[:k]))


def _finish(text: str, tail: str, calls: _Calls | None) -> list[Event]:
    """The end of a reply: content held back; with no call, the calls' part as written; else
    what followed the calls."""
    if not tail:
        return [Content(text)] if text else []
    if calls is None or calls.calls == 0:
        return [Content(tail)] if tail.strip() else []
    rest = calls.rest()
    return [Content(rest)] if rest else []
