"""vLLM's JSON-valued settings (`speculative_config`, `kv_events_config`): a dict or its JSON
text, checked to be an object whose keys this engine reads (an unknown one is refused by name)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def json_object(value: dict[str, Any] | str, name: str, keys: Sequence[str]) -> dict[str, Any]:
    """`value` as a dict of known keys; ValueError naming `name` (and the key) otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: is not a key this engine reads "
                         f"(it reads {', '.join(keys)})")
    return dict(value)
