"""`speculative_config`, in vLLM's JSON form: which proposer, how many tokens it drafts.

Accepted keys (vLLM's names): `method` ("ngram", "suffix" or "draft_model"), `model` (the draft
model's name or folder: it implies "draft_model"), `num_speculative_tokens`,
`prompt_lookup_min` / `prompt_lookup_max` (n-gram lengths tried, longest first),
`suffix_decoding_max_tree_depth`, `suffix_decoding_max_cached_requests` (finished requests
whose outputs the worker-wide trie holds; 0: the request's own tokens only),
`suffix_decoding_max_spec_factor` (a draft is at most this x the matched length),
`suffix_decoding_min_token_prob` (a draft stops where its cumulative share falls below this),
and `disable_by_batch_size` (no drafts in a step with more decoding requests than this). One key
is pdserve's own: `max_draft_tokens_per_step` (default 32; null: no limit), the drafts of one
step shared out evenly between its decoding requests. A CPU step costs about the same up to a
few dozen tokens (it reads every weight once) and grows with the tokens past that, so many
requests drafting in one step would cost more than their accepted drafts save. A key or method
this engine does not implement is refused with its name, never ignored.

The suffix method's global trie holds about `max_cached_requests` x output length x tree depth
nodes at most (shared substrings less): 256 requests of 500 tokens at depth 24, ~3 million.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.json_config import json_object

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's methods that need what this engine has not built yet (draft or EAGLE heads, MTP
# layers, suffix trees): refused with that said.
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
              "deepseek_mtp")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
         "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
         "disable_by_batch_size", "max_draft_tokens_per_step")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str | None = None  # draft_model: the draft's name or folder (the target's vocabulary)
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # no drafts in a step with more decoding requests than this (None: never off by size)
    disable_by_batch_size: int | None = None
    max_draft_tokens_per_step: int | None = 32

    @property
    def draft_tokens_per_step(self) -> int:
        return 1 << 30 if self.max_draft_tokens_per_step is None else self.max_draft_tokens_per_step

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method",
               f"{self.method!r} is not built in this version"
               if self.method in _NOT_BUILT else f"must be one of {METHODS}, got {self.method!r}")
        _check((self.method == "draft_model") == (self.model is not None), "model",
               "names the draft model, with method draft_model only"
               if self.model is not None else "method draft_model needs the draft's model")
        _check(_is_int(self.num_speculative_tokens)
               and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens",
               f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
               f"must be an integer of at least 1, got {self.prompt_lookup_min!r}")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
               "prompt_lookup_max",
               f"must be an integer in [prompt_lookup_min, 64], got {self.prompt_lookup_max!r}")
        _check(_is_int(self.suffix_decoding_max_tree_depth)
               and 2 <= self.suffix_decoding_max_tree_depth <= 64, "suffix_decoding_max_tree_depth",
               f"must be an integer in [2, 64], got {self.suffix_decoding_max_tree_depth!r}")
        _check(_is_int(self.suffix_decoding_max_cached_requests)
               and self.suffix_decoding_max_cached_requests >= 0,
               "suffix_decoding_max_cached_requests",
               f"must be a non-negative integer, got {self.suffix_decoding_max_cached_requests!r}")
        _check(isinstance(self.suffix_decoding_max_spec_factor, (int, float))
               and self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor",
               f"must be positive, got {self.suffix_decoding_max_spec_factor!r}")
        _check(isinstance(self.suffix_decoding_min_token_prob, (int, float))
               and 0 <= self.suffix_decoding_min_token_prob <= 1, "suffix_decoding_min_token_prob",
               f"must be in [0, 1], got {self.suffix_decoding_min_token_prob!r}")
        if self.max_draft_tokens_per_step is not None:
            _check(_is_int(self.max_draft_tokens_per_step) and self.max_draft_tokens_per_step >= 1,
                   "max_draft_tokens_per_step",
                   f"must be an integer of at least 1 or null, got {self.max_draft_tokens_per_step!r}")
        if self.disable_by_batch_size is not None:
            _check(_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
                   "disable_by_batch_size",
                   f"must be an integer of at least 1, got {self.disable_by_batch_size!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a dict, its JSON text, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        fields = json_object(value, "speculative_config", _KEYS)
        if fields.get("model") in (None, "ngram", "[ngram]"):  # vLLM's old spelling of ngram
            if fields.pop("model", None) is not None:
                fields.setdefault("method", "ngram")
        else:
            fields.setdefault("method", "draft_model")
        fields.setdefault("method", "ngram")
        if fields["method"] == "suffix" and "num_speculative_tokens" not in fields:
            # vLLM's default: as deep as the tree, here within MAX_SPECULATIVE_TOKENS
            fields["num_speculative_tokens"] = min(
                MAX_SPECULATIVE_TOKENS, fields.get("suffix_decoding_max_tree_depth", 24))
        return cls(**fields)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field_name}: {message}")
