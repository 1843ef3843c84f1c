"""What a request's output is constrained to (vLLM's `StructuredOutputsParams`).

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag` is set.
Pure data: it crosses the engine's process boundary inside `SamplingParams`.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """`json`: a JSON schema (a dict, or its JSON text; kept as text, key order preserved, since
    the order of `properties` is the order the output writes them). `regex`: the whole output
    matches it. `choice`: the output is one of these strings. `grammar`: EBNF (GBNF, as
    xgrammar and llama.cpp write it) or Lark. `json_object`: any JSON object. `structural_tag`:
    xgrammar's structural tag (JSON text). `disable_any_whitespace`: JSON without free
    whitespace between tokens (`whitespace_pattern`: whitespace matching it). `backend` is
    filled by the front end (`select.choose_backend`): the engine compiles with it."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None  # JSON's whitespace (llguidance only), as vLLM
    backend: str | None = None
    # field name for errors (the API field it came from, e.g. "response_format.json_schema")
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", jsonlib.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        set_kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"{self.source} must set exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(set_kinds) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one string (the grammar cache's key, with kind and flags)."""
        value: Any = getattr(self, self.kind)
        return value if isinstance(value, str) else jsonlib.dumps(value)

    @property
    def key(self) -> tuple[str, str, bool, str | None, str | None]:
        return (self.kind, self.spec, self.disable_any_whitespace, self.whitespace_pattern,
                self.backend)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (for `json`), else None."""
        return jsonlib.loads(self.json) if self.json is not None else None
