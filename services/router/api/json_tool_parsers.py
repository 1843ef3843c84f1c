"""Tool calls written as bare JSON, as vLLM's `llama3_json` and `mistral` parsers read them
(the Hermes tags and the event protocol: tool_parser.py).

- `llama3_json` (Llama 3.1 / 3.2 / 3.3): a reply that starts (after whitespace) with `{` or with
  `<|python_tag|>` is calls: JSON objects `{"name": ..., "parameters": {...}}` ("arguments" is
  taken too) separated by `;`. Any other reply is content.
- `mistral` (Mistral 7B v0.3, Mixtral, Mistral NeMo / Small): content, then `[TOOL_CALLS]` and a
  JSON array of `{"name": ..., "arguments": {...}}`. The tag is a special token: the router keeps
  special tokens in the text of requests parsed this way (as vLLM's mistral parser does).

Each call goes out once its JSON object is complete, its arguments as `json.dumps` writes them.
Whatever does not form a call (not an object with a string `name`, text after the calls, a
reply cut short) goes out as content at the end, as written. The events depend only on the text,
not on how it was cut into pieces.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.api.tool_parser import CallArguments, CallStart, Content, Event

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


def _call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


class _JsonCalls:
    """The calls part: objects one after another, between `separators`, optionally inside one
    array (`array=True`). Keeps the text it could not use for the end."""

    def __init__(self, array: bool, separators: str) -> None:
        self.array, self.separators = array, separators
        self.text = ""
        self.pos = 0  # used up to here
        self.opened = not array  # the array's "[" was seen
        self.closed = False  # the array's "]" (or a non-call) was seen: the rest is content
        self.calls = 0

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
            call = _call(obj)
            if call is None:
                self.closed = True
                return events
            self.pos += skip + end
            events += [CallStart(self.calls, call[0]), CallArguments(self.calls, call[1])]
            self.calls += 1
        return events

    def rest(self) -> str:
        """What never formed a call: content."""
        text = self.text[self.pos:]
        return text if text.strip() else ""


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
    """vLLM's `mistral` (the JSON-array form): content, then `[TOOL_CALLS][{...}, ...]`."""

    def __init__(self) -> None:
        self._text = ""  # content not yet sent (it may hold the tag's first characters)
        self._calls: _JsonCalls | None = None
        self._tail = ""  # the tag and what follows, as written

    def feed(self, text: str) -> list[Event]:
        if self._calls is not None:
            self._tail += text
            return self._calls.feed(text)
        self._text += text
        at = self._text.find(MISTRAL_TAG)
        if at >= 0:
            before, after = self._text[:at], self._text[at + len(MISTRAL_TAG):]
            self._text, self._tail = "", MISTRAL_TAG + after
            self._calls = _JsonCalls(array=True, separators=",")
            return [*([Content(before)] if before else []), *self._calls.feed(after)]
        keep = next(k for k in range(min(len(MISTRAL_TAG) - 1, len(self._text)), -1, -1)
                    if self._text.endswith(MISTRAL_TAG[:k]))
        out, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
        return [Content(out)] if out else []

    def finish(self) -> list[Event]:
        if self._calls is None:
            return [Content(self._text)] if self._text else []
        if self._calls.calls == 0:
            return [Content(self._tail)] if self._tail.strip() else []
        rest = self._calls.rest()
        return [Content(rest)] if rest else []
