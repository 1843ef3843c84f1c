"""The two grammar backends behind one interface: compile a spec once, make a matcher per request.

A matcher's `accept_tokens` / `is_terminated` are plain Python (the scheduler calls them), as is
xgrammar's `allows` (the step's check of an argmax row's unmasked choice); only the bitmask fill
touches a tensor (the manager calls it, between scheduling and sampling).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.structured.params import StructuredOutputsParams
from engine.structured.select import guidance_grammar, xgrammar_grammar


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_tokens(self, token_ids: list[int]) -> bool: ...  # False: a token the grammar forbids
    def is_terminated(self) -> bool: ...  # the grammar ended (its stop token accepted)
    def fork(self) -> Matcher: ...  # an independent copy at the same place (draft checks)


class Backend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...


class XgrammarMatcher:
    def __init__(self, matcher: Any, special_token_ids: frozenset[int] = frozenset()) -> None:
        self.inner = matcher  # xgrammar.GrammarMatcher
        # never allowed (xgrammar refuses them, with a warning each time it is asked)
        self.special_token_ids = special_token_ids

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(not self.inner.is_terminated() and self.inner.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def fork(self) -> XgrammarMatcher:
        return XgrammarMatcher(self.inner.fork(), self.special_token_ids)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next: its bitmask bit (xgrammar's mask is the set
        of tokens its matcher accepts), the matcher left where it was. Accepts the token and
        rolls it back: ~1-3 us, against ~0.35 ms for a bitmask row of 49,152 tokens.
        (llguidance has no such check: its mask holds only the canonical tokens of text the
        grammar forces, where its byte-level validation also accepts other splits.)"""
        inner = self.inner
        if token in self.special_token_ids or inner.is_terminated() or not inner.accept_token(token):
            return False
        inner.rollback(1)
        return True


class GuidanceMatcher:
    """llguidance stops a matcher as soon as its grammar cannot go on, before any stop token;
    this one, as xgrammar's, ends when the stop token (the only one allowed then) is accepted,
    so a request ends the same way, with the same tokens, whichever backend compiled it."""

    def __init__(self, matcher: Any, stop_token_ids: list[int]) -> None:
        self.inner = matcher  # llguidance.LLMatcher
        self.stop_token_ids = frozenset(stop_token_ids)
        self.terminated = False

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token in token_ids:
            if self.terminated:
                return False
            if not self.inner.is_stopped():
                if not self.inner.consume_token(token) or self.inner.is_error():
                    return False
            elif token not in self.stop_token_ids:
                return False
            # without stop tokens (a model with no eos), a grammar that cannot go on has ended
            self.terminated = (token in self.stop_token_ids
                               or (not self.stop_token_ids and self.inner.is_stopped()))
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def fork(self) -> GuidanceMatcher:
        copy = GuidanceMatcher(self.inner.deep_copy(), list(self.stop_token_ids))
        copy.terminated = self.terminated
        return copy

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.inner, bitmask, row)


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        # the manager caches compiled grammars by spec; xgrammar's own cache would hold them twice
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.special_token_ids = frozenset(self.info.special_token_ids) - set(stop_token_ids)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.compiler.compile_grammar(xgrammar_grammar(params))

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(compiled), self.special_token_ids)


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        from llguidance.hf import from_tokenizer

        self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size,
                                        eos_token=stop_token_ids or None)
        self.stop_token_ids = stop_token_ids

    def compile(self, params: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        grammar = guidance_grammar(params)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> GuidanceMatcher:
        from llguidance import LLMatcher

        return GuidanceMatcher(LLMatcher(self.tokenizer, compiled), self.stop_token_ids)
