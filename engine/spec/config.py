"""`speculative_config`, in vLLM's JSON form: which proposer, how many tokens it drafts.

Accepted keys (vLLM's names): `method` ("ngram"), `num_speculative_tokens`,
`prompt_lookup_min` / `prompt_lookup_max` (n-gram lengths tried, longest first) and
`disable_by_batch_size` (no drafts in a step with more decoding requests than this). A key or
method this engine does not implement is refused with its name, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
# vLLM's methods that need what this engine has not built yet (draft or EAGLE heads, MTP
# layers, suffix trees): refused with that said.
_NOT_BUILT = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
              "deepseek_mtp")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # no drafts in a step with more decoding requests than this (None: never off by size)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method",
               f"{self.method!r} is not built in this version"
               if self.method in _NOT_BUILT else f"must be one of {METHODS}, got {self.method!r}")
        _check(_is_int(self.num_speculative_tokens)
               and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens",
               f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
               f"must be an integer of at least 1, got {self.prompt_lookup_min!r}")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
               "prompt_lookup_max",
               f"must be an integer in [prompt_lookup_min, 64], got {self.prompt_lookup_max!r}")
        if self.disable_by_batch_size is not None:
            _check(_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
                   "disable_by_batch_size",
                   f"must be an integer of at least 1, got {self.disable_by_batch_size!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a dict, its JSON text, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS) - {"model"})
        _check(not unknown, unknown[0] if unknown else "", f"is not a key this engine reads "
               f"(it reads {', '.join(_KEYS)})")
        fields = dict(value)
        if "model" in fields:  # vLLM: a draft model's name or path (method draft_model)
            model = fields.pop("model")
            _check(model in (None, "ngram", "[ngram]"), "model",
                   f"a draft model ({model!r}) is not built in this version; use method ngram")
        fields.setdefault("method", "ngram")
        return cls(**fields)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field_name}: {message}")
