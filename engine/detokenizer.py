"""Incremental detokenization of a request's output tokens.

The text of new tokens is found by decoding a short window twice: the context tokens whose text
was already emitted (`[prefix_offset, read_offset)`) and the same context plus the new tokens
(`[prefix_offset, end)`); the new text is the difference. Decoding with a little context keeps
tokenizers that drop a leading space at the start of a decode (SentencePiece) correct. While the
window's text ends in U+FFFD (a multi-byte UTF-8 character split over tokens) nothing is
emitted; the bytes are completed by later tokens, or flushed when the request finishes.

Invariant: the concatenation of everything `update` returned, once the request finished,
equals `tokenizer.decode(token_ids, skip_special_tokens=..., spaces_between_special_tokens=...)`
(what the last one does is the tokenizer's: transformers' backends ignore it, as vLLM's fast
detokenizer does): always for byte-level BPE
tokenizers (GPT-2 style: SmolLM2, Llama 3, Qwen2), and for byte-fallback (SentencePiece)
tokenizers whenever the output is valid UTF-8 (a one-shot decode turns a whole invalid run of
byte tokens into U+FFFD, which no incremental decoder can know in advance). The context window
only moves on when new text appeared, so windows never start at text-less tokens.
"""

from __future__ import annotations

import weakref
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of text pieces."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""  # everything emitted so far
        self._prefix_offset = 0  # first token of the decoding context
        self._read_offset = 0  # tokens before this one have had their text emitted
        self.pending_text = ""  # decoded but held back: it ends in a partial character

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Adds tokens and returns the text they complete ("" while a character is partial).

        With `finished=True` any pending text is flushed, partial characters included.
        """
        self.token_ids.extend(new_token_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        context_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self.token_ids))
        if window_text.endswith(_REPLACEMENT_CHAR) and not finished:
            held = window_text.startswith(context_text)
            self.pending_text = window_text[len(context_text):] if held else ""
            return ""
        self.pending_text = ""
        if window_text.startswith(context_text):
            delta = window_text[len(context_text):]
        else:  # the context decodes differently with more tokens: diff the whole text
            delta = self._decode(0, len(self.token_ids))[len(self.output_text):]
        if not delta:
            return ""  # keep the context: a window starting at text-less tokens loses spaces
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        text: str = self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        return text


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (special tokens kept), for logprob entries; remembered
    per tokenizer (a prompt's logprobs ask for thousands of candidates, most seen before)."""
    try:
        texts = _TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: not remembered
        texts = {}
    text = texts.get(token_id)
    if text is None:
        text = str(tokenizer.decode([token_id], skip_special_tokens=False))
        texts[token_id] = text
    return text


# tokenizer -> token id -> its text (at most the vocabulary; gone with the tokenizer)
_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
