"""Sampling parameters of one request (vLLM's `SamplingParams`, validated on construction).

Pure Python: crosses the process boundary to the engine core as a msgspec-encoded dataclass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from engine.structured.params import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """How outputs are reported while a request runs."""

    CUMULATIVE = 0  # every output carries the whole text / token list so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Errors name the offending field.

    `top_k=-1` disables top-k; `top_p=1.0` disables top-p; `min_p=0.0` disables min-p;
    `temperature=0.0` is greedy. `logprobs=N` returns the N most likely tokens (plus the sampled
    one) of the model's raw distribution at each step. `stop` strings are matched on the
    detokenized text and are not part of the output unless `include_stop_str_in_output`.
    With `n > 1` and a `seed`, the i-th sample uses `seed + i`; a seeded sample's draw for its
    k-th output token depends only on (seed, k) (engine/sample/seeds.py).

    As vLLM: `logit_bias` adds to token logits (clamped to [-100, 100]); `allowed_token_ids`
    restricts sampling to those ids; `bad_words_token_ids` (the tokenized `bad_words`) bans each
    sequence's last token when the output ends with the rest of it; `prompt_logprobs=N` returns,
    for each prompt position after the first, the prompt token's logprob and the top-N.
    `structured_outputs` constrains the output (engine/structured): a grammar bitmask is applied
    to the logits before every other step of sampling, and a grammar that ends stops the request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # As vLLM: {"do_remote_decode": True} on a prefill request; the prefill's returned
    # kv_transfer_params (with "do_remote_prefill": True) on the decode request.
    kv_transfer_params: dict[str, Any] | None = None
    # The output is constrained to a JSON schema, regex, choice, grammar or structural tag.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        object.__setattr__(self, "stop", list(self.stop or []))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", _clamped_bias(self.logit_bias))
        else:
            object.__setattr__(self, "logit_bias", None)
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids",
                               [list(w) for w in self.bad_words_token_ids] or None)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            f"must be -1 (disabled) or at least 1, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be greater than 0, got {self.repetition_penalty}",
        )
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                f"must be at least 1, got {self.max_tokens}",
            )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be non-negative, got {self.min_tokens}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        if self.logprobs is not None:
            _check(
                isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
                "logprobs",
                f"must be in [0, 20], got {self.logprobs}",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative token ids",
        )
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        if self.prompt_logprobs is not None:
            _check(
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                f"must be in [0, 20], got {self.prompt_logprobs}",
            )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0
                and all(_is_token_id(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of non-negative token ids",
            )
        if self.bad_words_token_ids is not None:
            _check(
                all(w and all(_is_token_id(t) for t in w) for w in self.bad_words_token_ids),
                "bad_words",
                "must tokenize to non-empty sequences of token ids",
            )
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when a token id is outside [0, vocab_size)."""
        fields: list[tuple[str, list[int]]] = [
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", list(self.allowed_token_ids or ())),
            ("bad_words", [t for w in self.bad_words_token_ids or () for t in w]),
        ]
        for name, ids in fields:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, name, f"has token id {bad[0] if bad else 0} outside the vocabulary "
                                  f"[0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the `index`-th of `n` samples: n=1, seed shifted by the index."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _clamped_bias(bias: dict[int, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in bias.items():
        _check(_is_token_id(k), "logit_bias", f"keys must be token ids, got {k!r:.40}")
        _check(isinstance(v, int | float) and not isinstance(v, bool) and v == v, "logit_bias",
               f"values must be numbers, got {v!r:.40}")
        out[int(k)] = max(-100.0, min(100.0, float(v)))
    return out


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {message}")
