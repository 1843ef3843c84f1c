"""A response's output items and its event stream, built from its one sample's deltas.

    build = OutputBuilder(shape)                      # one per response
    events = build.start()                            # response.created, response.in_progress
    events += build.feed(delta)                       # per delta: items opened, text deltas...
    events += build.finish()                          # response.completed (or .incomplete)
    body = build.body()                               # the whole response object

The sample's text goes through the chat path's parsers (api/choice_text.py: reasoning first, then
tool calls), so a Responses reply holds what the chat reply to the same request holds: a
`reasoning` item (the reasoning parser's part), a `message` item (the content, as one
`output_text` part) and a `function_call` item per call, in the order the model wrote them. The
stream and the final body are built by the same calls, so they always agree. Logprobs (include
`message.output_text.logprobs`) cover every token of the sample, as vLLM's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.router.api.choice_text import ChoiceText
from services.router.fanout import Delta
from services.router.http.render import Reply, delta_logprobs
from services.router.responses.request import FunctionChoice, ResponsesRequest

Event = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """What a response's body says of its request."""

    id: str
    request: ResponsesRequest
    reply: Reply  # the chat reply it runs as: its parsers, prompt length, logprobs
    stored: bool
    created_at: int = field(default_factory=lambda: int(time.time()))


class OutputBuilder:
    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.text: ChoiceText | None = shape.reply.choice_text() if shape.reply.parsed else None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.seq = 0
        self.status = "in_progress"
        self.output_tokens = self.cached_tokens = self.reasoning_tokens = 0
        self.finish: str | None = None
        self.completed_at: int | None = None
        self.error: dict[str, Any] | None = None
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not gone out yet

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.body()),
                self._event("response.in_progress", response=self.body())]

    def feed(self, delta: Delta) -> list[Event]:
        """The events of one delta of the sample."""
        if delta.accepted:
            return []
        splitter = self.text.splitter if self.text is not None else None
        if splitter is not None and splitter.in_reasoning:
            self.reasoning_tokens += len(delta.token_ids)
        if delta.logprobs and (self.shape.request.logprobs or self.shape.request.top_logprobs):
            self._logprobs += delta_logprobs(self.shape.reply, delta)
        finished = bool(delta.finish_reason)
        if self.text is not None:
            bodies = self.text.deltas(delta.text, finished)
        else:
            bodies = [{"content": delta.text}] if delta.text else []
        events: list[Event] = []
        for body in bodies:
            if "reasoning" in body:
                events += self._reasoning(body["reasoning"])
            elif "content" in body:
                events += self._content(body["content"])
            for call in body.get("tool_calls", ()):
                events += self._call(call)
        self.output_tokens = delta.completion_tokens
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if finished:
            self.finish = delta.finish_reason
            # Text-less tokens' logprobs still go out; a reply of no text at all is an empty
            # message (chat's content ""), so every response has an output item.
            if self.open is None and (self._logprobs or not self.items):
                events += self._content("")
            events += self._close()
        return events

    def finish_events(self) -> list[Event]:
        """The closing event: response.completed, or response.incomplete at max_output_tokens."""
        events = self._close()
        incomplete = self.finish == "length"
        self.status = "incomplete" if incomplete else "completed"
        return [*events, self._event("response.incomplete" if incomplete else "response.completed",
                                     response=self.body())]

    def fail(self, code: str, message: str) -> list[Event]:
        """After a failure mid-stream: the open item closed, then response.failed."""
        events = self._close()
        self.status, self.error = "failed", {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self.body())]

    def body(self) -> dict[str, Any]:
        """The response object as it stands."""
        req, shape = self.shape.request, self.shape
        done = self.status in ("completed", "incomplete")
        if done and self.completed_at is None:
            self.completed_at = int(time.time())
        return {
            "id": shape.id, "object": "response", "created_at": shape.created_at, "status": self.status,
            "completed_at": self.completed_at,
            "background": False, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": shape.reply.model,
            "output": [dict(item) for item in self.items] if done or self.status == "failed" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "service_tier": "default", "store": shape.stored,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": _format(req), "verbosity": "medium"},
            "tool_choice": _tool_choice(req), "tools": list(req.tools or []),
            "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": "disabled",
            "usage": self.usage() if done else None, "user": req.user, "metadata": req.metadata or {},
        }

    def usage(self) -> dict[str, Any]:
        prompt = self.shape.reply.prompt_lens[0]
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": prompt + self.output_tokens}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _opened(self, kind: str, item: dict[str, Any]) -> list[Event]:
        events = self._close() if self.open is not None else []
        item = {"id": f"{kind}_{uuid.uuid4().hex}", **item, "status": "in_progress"}
        self.items.append(item)
        self.open = item
        return [*events, self._event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=_copy(item))]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._opened("rs", {"type": "reasoning", "summary": [], "content": []})
            events += self._part({"type": "reasoning_text", "text": ""})
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return [*events, self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                                     delta=text)]

    def _content(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "message":
            events += self._opened("msg", {"type": "message", "role": "assistant", "content": []})
            events += self._part({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        assert self.open is not None
        part = self.open["content"][0]
        logprobs, self._logprobs = self._logprobs, []
        part["text"] += text
        part["logprobs"] += logprobs
        return [*events, self._event("response.output_text.delta", **self._where(), content_index=0,
                                     delta=text, logprobs=logprobs)]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        function = call.get("function", {})
        if "id" in call:  # a new call: its header
            call_id = "call_" + str(call["id"]).removeprefix("chatcmpl-tool-")  # OpenAI's form
            return self._opened("fc", {"type": "function_call", "call_id": call_id,
                                       "name": function.get("name", ""), "arguments": ""})
        assert self.open is not None and self.open["type"] == "function_call"
        delta = function.get("arguments", "")
        self.open["arguments"] += delta
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=delta)]

    def _part(self, part: dict[str, Any]) -> list[Event]:
        assert self.open is not None
        self.open["content"].append(part)
        return [self._event("response.content_part.added", **self._where(), content_index=0,
                            part=_copy(part))]

    def _close(self) -> list[Event]:
        """The open item's closing events (none when no item is open)."""
        item = self.open
        if item is None:
            return []
        if self._logprobs and item["type"] == "message":
            item["content"][0]["logprobs"] += self._logprobs
            self._logprobs = []
        where = self._where()
        self.open = None
        cut = self.finish == "length" and item["type"] == "message"
        item["status"] = "incomplete" if cut else "completed"
        events: list[Event] = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                   logprobs=list(part["logprobs"])),
                       self._event("response.content_part.done", **where, content_index=0, part=_copy(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=part["text"]),
                       self._event("response.content_part.done", **where, content_index=0, part=_copy(part))]
        else:
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))
        return [*events, self._event("response.output_item.done", output_index=where["output_index"],
                                     item=_copy(item))]

    def chat_messages(self) -> list[dict[str, Any]]:
        """The output as the chat messages a later turn's conversation holds (previous_response_id)."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = (message["content"] or "") + item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        if message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
        return [message]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item (its content parts copied too): later deltas change the original."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, **({"logprobs": list(p["logprobs"])} if "logprobs" in p else {}))
                          for p in out["content"]]
    return out


def _format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    out = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
           "description": fmt.description}
    return {k: v for k, v in out.items() if v is not None}


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice if choice is not None else "auto"  # OpenAI's default (with no tools it calls none)
