"""The rows checked before any mask: an xgrammar matcher's `allows(token)` is its bitmask
bit, for every token of the vocabulary, in every state a request can be in (start, mid-way,
where the stop token is allowed, ended), and leaves the matcher where it was; and
`ArgmaxCheck.tokens` gives exactly the argmax of the masked values (ties, rows the grammar
leaves empty, rows out of batch order), filling masks only for the rows it must."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch

from engine.structured.bitmask import (
    ArgmaxCheck,
    CheckCounts,
    StepMask,
    additive_mask,
    allowed_mask,
    apply_token_bitmask_reference,
    masked_argmax,
)
from engine.structured.manager import StructuredOutputManager
from engine.structured.params import StructuredOutputsParams as SOP
from engine.structured.select import choose_backend
from tests.unit.engine.conftest import smollm2_tokenizer_dir
from tests.unit.engine.structured.conftest import EOS, VOCAB

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


def test_allows_is_the_bitmask_bit_along_the_benchmark_schemas(manager: StructuredOutputManager) -> None:
    """Random allowed paths through four of the benchmark's realistic schemas ($defs, enums,
    arrays with bounds, formats)."""
    from benchmarks.structured_workload import TASKS

    for n, (_, schema) in enumerate(TASKS[:4]):
        rng = random.Random(n)
        m = matcher(manager, SOP(json=json.dumps(schema)), "xgrammar")
        for step in range(5):
            bits = check_every_token(manager, m, f"task {n} step {step}")
            choices = [t for t in range(VOCAB) if bits[t] and t != EOS]
            assert m.accept_tokens([rng.choice(choices)])


def test_a_model_vocab_wider_than_the_tokenizers_allows_none_of_the_extra_ids() -> None:
    wide = StructuredOutputManager(str(smollm2_tokenizer_dir()), VOCAB + 64, EOS)
    try:
        state = wide.start(choose_backend(SOP(regex="[a-c]+"), "xgrammar"))
        state.future.result(timeout=WAIT_S)
        assert state.finish([]) is None
        m = state.matcher
        assert m is not None
        bits = allowed_mask(wide.bitmask([m]), VOCAB + 64)[0].tolist()
        assert [m.allows(t) for t in range(VOCAB + 64)] == bits  # type: ignore[attr-defined]
        assert not any(bits[VOCAB:])
    finally:
        wide.shutdown()


def test_special_tokens_are_refused_without_asking_xgrammar(manager: StructuredOutputManager) -> None:
    m = matcher(manager, SOP(regex="[a-c]+"), "xgrammar")
    m.special_token_ids = frozenset({5})  # (the default model's tokenizer declares none)
    asked: list[int] = []
    inner = m.inner

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def accept_token(self, token: int) -> bool:
            asked.append(token)
            return bool(inner.accept_token(token))

    m.inner = Spy()
    assert not m.allows(5) and asked == []
    assert not m.allows(6) and asked == [6]


class SetMatcher:
    """A matcher that allows a fixed set of tokens (for ArgmaxCheck alone)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def accept_tokens(self, token_ids: list[int]) -> bool:
        raise AssertionError("ArgmaxCheck never advances a matcher")

    def is_terminated(self) -> bool:
        return False


def bitmask_of(matchers: list[Any], vocab: int) -> torch.Tensor:
    """The backends' layout: bit t % 32 of int32 word t // 32 (little-endian bytes)."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(matchers), words * 32), dtype=bool)
    for i, m in enumerate(matchers):
        bits[i, sorted(m.allowed)] = True
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32))


def test_check_gives_the_argmax_of_the_masked_logits() -> None:
    rng = random.Random(4)
    vocab, n = 300, 9
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    logits[2, 10] = logits[2, 200] = 50.0  # a tie: the first maximum
    logits[5] = float("-inf")  # nothing left once masked (as min_tokens past a grammar's end)
    logits[6, :5] = 9.0  # ties among refused tokens
    logits[3, 17] = float("inf")  # a forbidden +inf (a tiny repetition penalty): still masked
    logits[7, 4] = float("nan")  # a forbidden NaN: masked as well
    rows = [7, 2, 5, 0, 6, 3]  # the checked rows, out of batch order
    allowed = [set(rng.sample(range(vocab), 40)) for _ in rows]
    allowed[1] |= {10}  # allowed first maximum: kept
    allowed[1] -= {200}
    allowed[3] |= {int(logits[0].argmax())}
    allowed[4] = {3, 4, 250}  # refused first maxima: the first allowed one of the tie wins
    allowed[2] = {7}  # refused (argmax 0 of an all -inf row), and the mask leaves nothing
    allowed[5] -= {17}
    allowed[0] -= {4}
    matchers = [SetMatcher(a) for a in allowed]
    fills: list[int] = []

    def fill(ms: list[Any]) -> StepMask:
        fills.append(len(ms))
        bm = bitmask_of(ms, vocab)
        return StepMask(bm, additive_mask(bm, vocab))  # (the check masks from the bitmask)

    counts = CheckCounts()
    check = ArgmaxCheck([f"r{r}" for r in rows], [True] * len(rows), matchers,  # type: ignore[arg-type]
                        fill, counts)
    before = logits.clone()
    tokens = check.tokens(logits, logits.argmax(dim=-1), list(enumerate(rows)))
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)  # not modified
    want = logits.argmax(dim=-1)
    masked = logits.clone()
    apply_token_bitmask_reference(masked, bitmask_of(matchers, vocab), rows)
    want[rows] = masked[rows].argmax(dim=-1)
    assert tokens.tolist() == want.tolist()
    assert tokens[2] == 10 and tokens[6] == 3 and tokens[5] == 0 and int(tokens[3]) in allowed[5]
    refused = [i for i, r in enumerate(rows) if int(logits[r].argmax()) not in allowed[i]]
    assert fills == [len(refused)] and 0 < len(refused) < len(rows)  # one fill, refused rows only
    assert (counts.checked, counts.refused) == (len(rows), len(refused))
    some = [(4, rows[4]), (1, rows[1]), (2, rows[2])]  # a subset, out of order: i is not the place
    subset = check.tokens(logits, logits.argmax(dim=-1), some)
    unchecked = [r for r in range(n) if r not in {row for _, row in some}]
    assert subset[unchecked].tolist() == logits.argmax(dim=-1)[unchecked].tolist()
    assert [int(subset[row]) for _, row in some] == [int(want[row]) for _, row in some]


@pytest.mark.parametrize("vocab", [1, 31, 64, 1000, VOCAB])
def test_masked_argmax_is_the_argmax_of_the_masked_row(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    for case in range(12):
        row = torch.randn(vocab + (5 if case % 3 == 0 else 0), generator=gen)  # wider than the mask
        if case % 4 == 1:
            row[torch.rand(row.shape, generator=gen) < 0.5] = float("-inf")
        if case % 4 == 2:
            row[: max(1, vocab // 3)] = row.max()  # ties
        bitmask = torch.randint(-(2**31), 2**31, (words,), dtype=torch.int64, generator=gen)
        bitmask = bitmask.to(torch.int32)
        if case == 5:
            bitmask.zero_()  # nothing allowed
        if case == 7:
            row[:] = float("-inf")
        want = row.clone()[None]
        apply_token_bitmask_reference(want, bitmask[None], [0])
        assert masked_argmax(row, bitmask) == int(want[0].argmax()), case


def test_no_refusal_fills_nothing_and_keeps_the_tokens() -> None:
    logits = torch.randn(3, 64)
    tokens = logits.argmax(dim=-1)
    matchers = [SetMatcher({int(t)}) for t in tokens]

    def fill(ms: list[Any]) -> StepMask:
        raise AssertionError("nothing to fill")

    check = ArgmaxCheck(["a", "b", "c"], [True, False, True], matchers, fill)  # type: ignore[arg-type]
    assert check.tokens(logits, tokens, [(0, 0), (1, 1), (2, 2)]) is tokens
    assert check.tokens(logits, tokens, []) is tokens
    assert check.counts.checked == 3
