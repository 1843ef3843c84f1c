"""Incremental detokenization equals a one-shot `tokenizer.decode` of all output tokens."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷 done.",
    "中文字符测试，日本語のテキスト、한국어 문장.",
    "naïve café — “quotes” … ∑∫√ spaces   and\ttabs\nnew lines\n\n",
    "<|im_start|>user\nhi<|im_end|>",
]




def stream(tokenizer, token_ids: list[int], skip_special_tokens: bool = True,
           chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    pieces = []
    for i in range(0, len(token_ids), chunk):
        last = i + chunk >= len(token_ids)
        pieces.append(detok.update(token_ids[i:i + chunk], finished=last))
    return pieces, detok.output_text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_of_real_texts(tokenizer, text, skip_special_tokens):
    ids = tokenizer(text).input_ids
    pieces, output_text = stream(tokenizer, ids, skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected == output_text


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_split_multibyte_characters_never_stream_a_replacement_char(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert "\ufffd" in "".join(tokenizer.decode([i]) for i in ids)  # really split over tokens
    pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(8))
def test_streamed_text_equals_full_decode_of_random_tokens(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
    for chunk in (1, 3):
        pieces, _ = stream(tokenizer, ids, skip_special_tokens=bool(seed % 2), chunk=chunk)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=bool(seed % 2))


def test_partial_character_is_flushed_when_the_request_finishes(tokenizer):
    emoji_ids = tokenizer("🎉").input_ids
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(emoji_ids[:1]) == ""
    assert detok.update([], finished=True) == tokenizer.decode(emoji_ids[:1])


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "ing", "▁", "!",
             "<0xE4>", "<0xB8>", "<0xAD>", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("seed", range(40))
def test_leading_space_stripping_tokenizers_stream_exactly(sentencepiece_style_tokenizer, seed):
    # Words, lone spaces, special tokens and whole multi-byte characters ("中", "🎉").
    units = [[0], [1], [2], [3], [4], [5], [6], [7], [8, 9, 10], [11, 12, 13, 14]]
    rng = random.Random(seed)
    ids = [t for _ in range(rng.randint(1, 15)) for t in rng.choice(units)]
    for skip in (True, False):
        pieces, _ = stream(sentencepiece_style_tokenizer, ids, skip_special_tokens=skip)
        assert "".join(pieces) == sentencepiece_style_tokenizer.decode(
            ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)


def test_decode_token_remembers_each_tokens_text_per_tokenizer() -> None:
    from engine.detokenizer import decode_token

    class Counting:
        def __init__(self, prefix: str) -> None:
            self.prefix, self.calls = prefix, 0

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            assert not skip_special_tokens
            self.calls += 1
            return f"{self.prefix}{ids[0]}"

    a, b = Counting("a"), Counting("b")
    assert [decode_token(a, t) for t in (5, 6, 5, 5)] == ["a5", "a6", "a5", "a5"]
    assert decode_token(b, 5) == "b5"  # another tokenizer: its own texts
    assert (a.calls, b.calls) == (2, 1)
