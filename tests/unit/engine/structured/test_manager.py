"""StructuredOutputManager: grammars compile in its own threads (never the caller's), once per
spec (cached; requests of one spec arriving together share one compile); a compile that raises
fails only its request; the step's bitmask rows are what each grammar allows next."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

from engine.structured.backends import GuidanceMatcher, XgrammarBackend, XgrammarMatcher
from engine.structured.bitmask import allowed_mask
from engine.structured.manager import StructuredOutputManager
from engine.structured.params import StructuredOutputsParams as SOP
from engine.structured.select import choose_backend
from tests.unit.engine.conftest import smollm2_tokenizer_dir
from tests.unit.engine.structured.conftest import EOS, VOCAB

WAIT_S = 60  # bound on every wait (a compile takes well under a second)


def ready(manager: StructuredOutputManager, params: SOP, prior: list[int] | None = None,
          backend: str = "auto") -> Any:
    """The compiled matcher of `params` (advanced over `prior` outputs)."""
    state = manager.start(choose_backend(params, backend))
    state.future.result(timeout=WAIT_S)
    assert state.finish(prior or []) is None
    return state.matcher


def wait_done(state: Any) -> None:
    with contextlib.suppress(RuntimeError):  # a compile that raised: finish() reports it
        state.future.result(timeout=WAIT_S)


class CompileSpy:
    """Wraps XgrammarBackend.compile: records the threads it ran on and the specs, optionally
    holds each compile until `release` is set, and raises for specs containing `fail_on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: bool = False,
                 fail_on: str | None = None) -> None:
        self.threads: list[str] = []
        self.specs: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        real = XgrammarBackend.compile

        def compile(backend: XgrammarBackend, params: SOP) -> Any:
            self.threads.append(threading.current_thread().name)
            self.specs.append(params.spec)
            self.entered.set()
            assert self.release.wait(WAIT_S)
            if fail_on is not None and fail_on in params.spec:
                raise RuntimeError("compiler exploded")
            return real(backend, params)

        monkeypatch.setattr(XgrammarBackend, "compile", compile)


def test_a_repeated_spec_hits_the_cache_and_a_new_one_misses(manager: StructuredOutputManager,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spy = CompileSpy(monkeypatch)
    before = (manager.stats.misses, manager.stats.hits)
    ready(manager, SOP(regex="cache-[0-9]"))
    ready(manager, SOP(regex="cache-[0-9]"))
    ready(manager, SOP(regex="cache-[0-9]", source="guided_regex"))  # the field name is no part
    ready(manager, SOP(regex="cache-[0-8]"))
    assert (manager.stats.misses, manager.stats.hits) == (before[0] + 2, before[1] + 2)
    assert spy.specs == ["cache-[0-9]", "cache-[0-8]"]


def test_compiles_run_in_the_grammar_threads_not_the_callers(manager: StructuredOutputManager,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spy = CompileSpy(monkeypatch, hold=True)
    state = manager.start(choose_backend(SOP(regex="thread-[0-9]")))
    assert spy.entered.wait(WAIT_S)
    assert not state.ready  # start() returned while the compile is held
    spy.release.set()
    state.future.result(timeout=WAIT_S)
    assert spy.threads and spy.threads[0].startswith("grammar")
    assert threading.current_thread().name not in spy.threads


def test_requests_of_one_spec_arriving_together_compile_it_once(
        manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = CompileSpy(monkeypatch, hold=True)
    states = [manager.start(choose_backend(SOP(choice=["together", "apart"]))) for _ in range(3)]
    assert spy.entered.wait(WAIT_S)
    spy.release.set()
    for state in states:
        state.future.result(timeout=WAIT_S)
        assert state.finish([]) is None
    assert spy.specs == ['["together", "apart"]']
    assert len({id(s.matcher) for s in states}) == 3  # one matcher each


def test_a_compile_that_raises_fails_only_its_request_and_is_not_cached(
        manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch) -> None:
    CompileSpy(monkeypatch, fail_on="boom")
    bad = manager.start(choose_backend(SOP(regex="boom[0-9]")))
    good = manager.start(choose_backend(SOP(regex="fine[0-9]")))
    for state in (bad, good):
        wait_done(state)
    error = bad.finish([])
    assert error is not None and error.startswith("structured outputs: the grammar failed to "
                                                  "compile: compiler exploded")
    assert bad.matcher is None
    assert good.finish([]) is None and good.matcher is not None
    again = manager.start(choose_backend(SOP(regex="boom[0-9]")))
    wait_done(again)
    assert again.finish([]) is not None  # compiled (and failed) again, not a cached failure


def test_the_cache_keeps_the_most_recent_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = CompileSpy(monkeypatch)
    m = StructuredOutputManager(str(smollm2_tokenizer_dir()), VOCAB, EOS, cache_size=2)
    try:
        for spec in ["a", "b", "a", "c", "a", "b"]:  # b is evicted by c (a was used more lately)
            ready(m, SOP(regex=spec))
        assert spy.specs == ["a", "b", "c", "b"]
    finally:
        m.shutdown()


def test_earlier_outputs_advance_the_matcher_or_fail_the_request(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    ids = tokenizer.encode("ab", add_special_tokens=False)
    matcher = ready(manager, SOP(regex="ab[0-9]"), prior=ids)
    assert not matcher.is_terminated()
    state = manager.start(choose_backend(SOP(regex="ab[0-9]")))
    state.future.result(timeout=WAIT_S)
    wrong = tokenizer.encode("xy", add_special_tokens=False)
    assert state.finish(wrong) == ("structured outputs: the earlier output tokens do not match "
                                   "the grammar")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_bitmask_rows_allow_what_each_grammar_allows_next(manager: StructuredOutputManager,
                                                         tokenizer: Any, backend: str) -> None:
    digits = ready(manager, SOP(regex="[0-9]"), backend=backend)
    done = ready(manager, SOP(choice=["ok"]), backend=backend)
    ok_ids = tokenizer.encode("ok", add_special_tokens=False)
    assert done.accept_tokens(ok_ids)
    kind = XgrammarMatcher if backend == "xgrammar" else GuidanceMatcher
    assert isinstance(digits, kind)
    bitmask = manager.bitmask([digits, done, digits])  # two rows of one grammar: the batch fill
    assert bitmask.shape == (3, VOCAB // 32) and bitmask.dtype == torch.int32
    allowed = allowed_mask(bitmask, VOCAB)
    digit_ids = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert set(allowed[0].nonzero().flatten().tolist()) == digit_ids
    assert torch.equal(allowed[0], allowed[2])
    assert allowed[1].nonzero().flatten().tolist() == [EOS]  # the grammar ended: only the stop
    for in_thread in (True, False):  # the step's fill: in the fill thread (GPU) or here (CPU)
        step = manager.fill([digits, done, digits], additive=True, in_thread=in_thread)
        assert torch.equal(step.result(timeout=WAIT_S).bitmask, bitmask)
        additive = step.result().additive
        assert additive is not None and torch.equal(additive == 0, allowed)
        no_add = manager.fill([digits], additive=False, in_thread=in_thread)
        assert no_add.result(timeout=WAIT_S).additive is None


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_grammar_ends_when_its_stop_token_is_accepted_with_either_backend(
        manager: StructuredOutputManager, tokenizer: Any, backend: str) -> None:
    done = ready(manager, SOP(choice=["ok"]), backend=backend)  # nothing can follow "ok" but the stop token
    assert done.accept_tokens(tokenizer.encode("ok", add_special_tokens=False))
    assert not done.is_terminated()
    assert not done.accept_tokens([tokenizer.convert_tokens_to_ids("k")])
    assert done.accept_tokens([EOS]) and done.is_terminated()
    assert not done.accept_tokens([EOS])  # nothing after the end
    more = ready(manager, SOP(regex="[0-9]+"), backend=backend)  # may go on: the stop ends it
    assert more.accept_tokens([*tokenizer.encode("12", add_special_tokens=False), EOS])
    assert more.is_terminated()
    early = ready(manager, SOP(regex="[0-9]+"), backend=backend)
    assert not early.accept_tokens([EOS]) and not early.is_terminated()  # "" does not match


def test_xgrammar_and_llguidance_rows_in_one_bitmask(manager: StructuredOutputManager,
                                                    tokenizer: Any) -> None:
    xgr = ready(manager, SOP(regex="[0-9]", backend="xgrammar"))
    llg = ready(manager, SOP(choice=["A", "B"], backend="guidance"))
    allowed = allowed_mask(manager.bitmask([llg, xgr]), VOCAB)
    first = {tokenizer.convert_tokens_to_ids(t) for t in ("A", "B")}
    assert set(allowed[0].nonzero().flatten().tolist()) >= first
    assert not allowed[0][tokenizer.convert_tokens_to_ids("0")]
    assert allowed[1][tokenizer.convert_tokens_to_ids("0")]
    assert not allowed[1][tokenizer.convert_tokens_to_ids("A")]
