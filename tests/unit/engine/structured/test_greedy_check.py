"""The greedy rows checked before any mask: an xgrammar matcher's `allows(token)` is its bitmask
bit, for every token of the vocabulary, in every state a request can be in (start, mid-way,
where the stop token is allowed, ended), and leaves the matcher where it was; and
`GreedyCheck.tokens` gives exactly the argmax of the masked logits (ties, rows the grammar
leaves empty, rows out of batch order), filling masks only for the rows it must."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from engine.structured.bitmask import (
    GreedyCheck,
    GreedyCounts,
    StepMask,
    additive_mask,
    allowed_mask,
    apply_token_bitmask_reference,
)
from engine.structured.manager import StructuredOutputManager
from engine.structured.params import StructuredOutputsParams as SOP
from engine.structured.select import choose_backend
from tests.unit.engine.conftest import smollm2_tokenizer_dir

VOCAB = 49152
EOS = 2
WAIT_S = 60
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
          "required": ["n"], "additionalProperties": False}
# spec -> a text the grammar accepts whole (walked token by token)
CASES = {
    "json": (SOP(json=json.dumps(SCHEMA)), '{"n": 12, "s": "hi there"}'),
    "regex": (SOP(regex=r"[a-c]{2,6}-\d{1,3}"), "abca-42"),
    "choice": (SOP(choice=["red", "green"]), "green"),
    "grammar": (SOP(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] | [0-9]'),
                "(a,7,q)"),
}


@pytest.fixture(scope="module")
def manager() -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(str(smollm2_tokenizer_dir()), VOCAB, EOS)
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.model.loader import load_tokenizer

    return load_tokenizer(smollm2_tokenizer_dir())


def matcher(manager: StructuredOutputManager, spec: SOP, backend: str) -> Any:
    state = manager.start(choose_backend(spec, backend))
    state.future.result(timeout=WAIT_S)
    assert state.finish([]) is None
    return state.matcher


def allowed_now(manager: StructuredOutputManager, m: Any) -> list[bool]:
    return allowed_mask(manager.bitmask([m]), VOCAB)[0].tolist()


def check_every_token(manager: StructuredOutputManager, m: Any, where: str) -> list[bool]:
    bits = allowed_now(manager, m)
    got = [m.allows(t) for t in range(VOCAB)]
    assert got == bits, (where, [t for t in range(VOCAB) if got[t] != bits[t]][:10])
    assert allowed_now(manager, m) == bits  # the checks left the matcher where it was
    return bits


@pytest.mark.parametrize("case", list(CASES))
def test_allows_is_the_bitmask_bit_for_every_token_in_every_state(
        manager: StructuredOutputManager, tokenizer: Any, case: str) -> None:
    """Along the canonical tokens of an accepted text, then along random allowed tokens (other
    splits of forced text, where llguidance's mask and its validation part ways)."""
    spec, text = CASES[case]
    m = matcher(manager, spec, "xgrammar")
    path = [*tokenizer.encode(text, add_special_tokens=False), EOS]
    for step, token in enumerate(path):
        bits = check_every_token(manager, m, f"{case} step {step}")
        assert bits[token] and m.accept_tokens([token])
    assert m.is_terminated()
    assert not any(m.allows(t) for t in range(VOCAB))  # nothing after the end
    rng = random.Random(case)
    m = matcher(manager, spec, "xgrammar")
    for step in range(12):
        bits = check_every_token(manager, m, f"{case} random step {step}")
        choices = [t for t in range(VOCAB) if bits[t] and t != EOS]
        if not choices:
            break
        assert m.accept_tokens([rng.choice(choices)])


class SetMatcher:
    """A matcher that allows a fixed set of tokens (for GreedyCheck alone)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def accept_tokens(self, token_ids: list[int]) -> bool:
        raise AssertionError("GreedyCheck never advances a matcher")

    def is_terminated(self) -> bool:
        return False


def bitmask_of(matchers: list[Any], vocab: int) -> torch.Tensor:
    """The backends' layout: bit t % 32 of int32 word t // 32 (little-endian bytes)."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(matchers), words * 32), dtype=bool)
    for i, m in enumerate(matchers):
        bits[i, sorted(m.allowed)] = True
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32))


@pytest.mark.parametrize("additive", [True, False], ids=["additive", "bitmask"])
def test_check_gives_the_argmax_of_the_masked_logits(additive: bool) -> None:
    rng = random.Random(4)
    vocab, n = 300, 9
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    logits[2, 10] = logits[2, 200] = 50.0  # a tie: the first maximum
    logits[5] = float("-inf")  # a row with nothing left (as min_tokens past a grammar's end)
    logits[6, :5] = 9.0  # ties among refused tokens
    rows = [7, 2, 5, 0, 6, 3]  # the checked rows, out of batch order
    allowed = [set(rng.sample(range(vocab), 40)) for _ in rows]
    allowed[1] |= {10}  # allowed first maximum: kept
    allowed[1] -= {200}
    allowed[3] |= {int(logits[0].argmax())}
    allowed[4] = {3, 4, 250}  # refused first maxima: the first allowed one of the tie wins
    allowed[2] = {0}
    matchers = [SetMatcher(a) for a in allowed]
    fills: list[int] = []

    def fill(ms: list[Any]) -> StepMask:
        fills.append(len(ms))
        bm = bitmask_of(ms, vocab)
        return StepMask(bm, additive_mask(bm, vocab) if additive else None)

    counts = GreedyCounts()
    check = GreedyCheck([f"r{r}" for r in rows], matchers, fill, counts)  # type: ignore[arg-type]
    before = logits.clone()
    tokens = check.tokens(logits, logits.argmax(dim=-1), rows)
    assert torch.equal(logits, before)  # not modified
    want = logits.argmax(dim=-1)
    masked = logits.clone()
    apply_token_bitmask_reference(masked, bitmask_of(matchers, vocab), rows)
    want[rows] = masked[rows].argmax(dim=-1)
    assert tokens.tolist() == want.tolist()
    assert tokens[2] == 10 and tokens[6] == 3 and tokens[5] == 0
    refused = [i for i, r in enumerate(rows) if int(logits[r].argmax()) not in allowed[i]]
    assert fills == [len(refused)] and 0 < len(refused) < len(rows)  # one fill, refused rows only
    assert (counts.checked, counts.refused) == (len(rows), len(refused))


def test_no_refusal_fills_nothing_and_keeps_the_tokens() -> None:
    logits = torch.randn(3, 64)
    tokens = logits.argmax(dim=-1)
    matchers = [SetMatcher({int(t)}) for t in tokens]

    def fill(ms: list[Any]) -> StepMask:
        raise AssertionError("nothing to fill")

    check = GreedyCheck(["a", "b", "c"], matchers, fill)  # type: ignore[arg-type]
    assert check.tokens(logits, tokens, [0, 1, 2]) is tokens
