"""The router's store of responses (`store: true`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`), in memory and bounded, off unless the router runs with
--enable-responses-store (as vLLM keeps its store off unless VLLM_ENABLE_RESPONSES_API_STORE).

Each stored response keeps its body and its conversation as chat messages (the turns before it,
its input, its output; not its instructions, which do not carry over, as OpenAI's). The store
holds at most `max_responses` of them and `max_bytes` of their JSON; past either, the least
recently used go first. Responses are kept per tenant (services/router/http/tenants.py): with
--tenant-cache-salt a key never reads, continues or deletes another key's responses (they answer
404, as ids that do not exist). Each router has its own store: run one router, or route a
conversation's requests to the same one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stored:
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation through this response, as chat messages
    size: int
    items: list[dict[str, Any]] = field(default_factory=list)  # its input, as items with ids


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the responses store needs room for at least one response")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.bytes = 0
        # Requests with large bodies are prepared in the tokenizer pool: they read it there.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, body: dict[str, Any], messages: list[dict[str, Any]],
            items: list[dict[str, Any]] | None = None) -> bool:
        """Keep a response (with its input items); False when it alone is larger than the store."""
        items = items or []
        size = len(json.dumps(body)) + len(json.dumps(messages)) + len(json.dumps(items))
        if size > self.max_bytes:
            return False
        key = (tenant, str(body["id"]))
        with self._lock:
            self._pop(key)
            self._items[key] = Stored(body, messages, size, items)
            self.bytes += size
            while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.size
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        key = (tenant, response_id)
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._pop((tenant, response_id))

    def _pop(self, key: tuple[str, str]) -> bool:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None
