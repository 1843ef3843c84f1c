"""A large request body's shape, checked before it is parsed. Parsing and validating cost time in
proportion to the JSON items (objects, arrays, their members) a body holds, and that time holds
the GIL, so the event loop too, even when it runs in another thread: 250,000 empty messages are
8 MB of JSON that parse and validate in ~2 s. No request the router can serve needs that much
structure, so a body that holds more than its fields can use is a 400 naming the field before
anything parses it.

    check_shape(raw, ShapeLimits.for_model(max_model_len))   # OpenAIError 400, or nothing

How: the top level is split into its fields' raw JSON (msgspec, in C, no values built). Each
field's commas and brackets bound its items from above (`bytes.count`, ~1 ms a MB); a field
within its limit by that bound is done. Token-id lists and logit_bias hold no strings that could
carry commas, so over the limit they are refused at once; the messages' count is read from
their raw items (C, ~30 ms for 250,000); any other field over the bound is counted exactly
(msgspec's decoder, in C). The fields together (unknown ones too), token-id prompts apart, hold at
most `items`, whatever max_model_len is. A body that needs counting but that msgspec does not
take (malformed, nested past its depth, or with the escape of a lone surrogate, which only
`json.loads` would parse) is a 400: nothing would bound what a lenient parse of it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.router.api.openai_models import MAX_LIST_FIELD, MAX_PROMPTS, MAX_STOP_STRINGS
from services.router.errors import OpenAIError

_TOKEN_LISTS = ("logit_bias", "allowed_token_ids", "stop_token_ids")  # ids: no strings inside


MAX_ITEMS = 32_768  # ~0.1 s of validation holding the GIL on this project's 2-core VMs
MAX_MESSAGES = 8_192


@dataclass(frozen=True)
class ShapeLimits:
    items: int  # JSON items of all fields but a token-id prompt (messages, parts, tools, extras...)
    messages: int  # chat messages: each renders to at least one token
    prompt_items: int  # a completion's prompt: up to MAX_PROMPTS token-id lists of max_model_len

    @classmethod
    def for_model(cls, max_model_len: int) -> ShapeLimits:
        return cls(items=min(max(8 * max_model_len, 4096), MAX_ITEMS),
                   messages=min(max_model_len, MAX_MESSAGES),
                   prompt_items=(MAX_PROMPTS + 1) * (max_model_len + 2))


def check_shape(raw: bytes, limits: ShapeLimits) -> None:
    """An OpenAIError 400 naming the first field of `raw` that holds more JSON items than it may,
    or when the fields together hold more than `limits.items`."""
    if _upper_bound(raw) <= min(limits.items, MAX_LIST_FIELD):
        return
    try:
        fields = {name: bytes(value) for name, value in
                  msgspec.json.decode(raw, type=dict[str, msgspec.Raw]).items()}
        counts = {name: _check_field(name, span, limits) for name, span in fields.items()}
        counts.pop("prompt", None)  # token ids: cheap to validate, bounded by their own limit
        for name in sorted(counts, key=lambda n: -counts[n]):  # bounds: count exactly where needed
            if sum(counts.values()) <= limits.items:
                break
            if name not in _TOKEN_LISTS:
                counts[name] = _items(msgspec.json.decode(fields[name]), limits.items)
        total = sum(counts.values())
    except msgspec.ValidationError:
        raise OpenAIError(400, "the request body must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise OpenAIError(400, f"malformed JSON body (a large body must be strict JSON: no escape "
                               f"of a lone surrogate, nested at most 1,000 deep): {e}"[:300]) from None
    if total > limits.items:
        raise OpenAIError(400, f"the request body holds {total} JSON objects, arrays and members, "
                               f"more than the {limits.items} a request may")


def _upper_bound(span: bytes) -> int:
    return span.count(b",") + span.count(b"{") + span.count(b"[")


def _check_field(name: str, span: bytes, limits: ShapeLimits) -> int:
    """The field's items (an upper bound where that is within its limit), or a 400 naming it."""
    bound = _upper_bound(span)
    if name in _TOKEN_LISTS:
        limit = MAX_LIST_FIELD if name != "stop_token_ids" else MAX_STOP_STRINGS
        if bound > limit + 1:  # + the container itself
            raise _refusal(name, f"holds more than the {limit} entries it may have")
        return bound
    limit = limits.prompt_items if name == "prompt" else limits.items
    if bound <= limit:
        return bound
    if name == "messages" and span.lstrip()[:1] == b"[":
        count = len(msgspec.json.decode(span, type=list[msgspec.Raw]))
        if count > limits.messages:
            raise _refusal(name, f"{count} messages, more than the {limits.messages} a request may "
                                 f"have (each renders to at least one token)")
    items = _items(msgspec.json.decode(span), limit)
    if items > limit:
        raise _refusal(name, f"holds more than {limit} JSON objects, arrays and members, more "
                             f"than a request may")
    return items


def _items(value: object, limit: int) -> int:
    """Containers and their members in a decoded JSON value, counted until past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, dict):
            total += 1 + len(item)
            stack.extend(v for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            total += 1 + len(item)
            stack.extend(v for v in item if isinstance(v, dict | list))
    return total


def _refusal(name: str, why: str) -> OpenAIError:
    return OpenAIError(400, f"{name}: {why}", name)
