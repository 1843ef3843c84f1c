"""StructuredOutputManager: grammars compiled off the scheduler's thread, cached by spec, and one
step's token bitmask filled for its constrained rows in one pass (vLLM's manager, in small; on
CPU the rows an argmax samples are filled only when their unmasked choice is refused, in a
second pass).

    manager = StructuredOutputManager(tokenizer_path, vocab_size=49152, eos_token_id=2)
    state = manager.start(params)          # compiles in the manager's threads
    ...                                    # the request waits (WAITING_FOR_FSM) until state.ready
    error = state.finish(prior_outputs)    # the matcher, advanced over outputs it continues from
    bitmask = manager.bitmask([state.matcher, ...])  # [rows, ceil(vocab / 32)] int32, 1 = allowed
    future = manager.fill([state.matcher, ...], additive=True, in_thread=True)  # while the model runs
    check = manager.argmax_check([req_id, ...], [greedy, ...], [state.matcher, ...])  # masks on demand
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.structured.backends import (
    Backend,
    GuidanceBackend,
    GuidanceMatcher,
    Matcher,
    XgrammarBackend,
    XgrammarMatcher,
)
from engine.structured.bitmask import ArgmaxCheck, CheckCounts, StepMask, additive_mask
from engine.structured.params import StructuredOutputsParams
from engine.structured.select import choose_backend

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[XgrammarBackend] | type[GuidanceBackend]] = {
    "xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


class GrammarState:
    """One request's grammar: compiling until `ready`, then its matcher (or the error)."""

    def __init__(self, future: Future[Matcher]) -> None:
        self.future = future
        self.matcher: Matcher | None = None

    @property
    def ready(self) -> bool:
        return self.future.done()

    def finish(self, prior_outputs: list[int]) -> str | None:
        """Takes the compiled matcher and advances it over the sample's earlier outputs (the
        prefill worker's first token, tokens before a migration); the error text, or None."""
        try:
            matcher = self.future.result()
        except Exception as e:  # a grammar this engine cannot compile: that request fails
            return f"structured outputs: the grammar failed to compile: {e}"[:500]
        if prior_outputs and not matcher.accept_tokens(prior_outputs):
            return "structured outputs: the earlier output tokens do not match the grammar"
        self.matcher = matcher
        return None

    def cancel(self) -> None:
        self.future.cancel()


@dataclass
class CompileStats:
    """Compiles since start-up: misses compiled a spec, hits found it cached."""

    misses: int = 0
    hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # each miss's time


class StructuredOutputManager:
    """Thread-safe compile side; `bitmask` runs on the engine's step thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_id: int | None,
                 backend: str = "auto", cache_size: int = 512, threads: int = 2) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = [eos_token_id] if eos_token_id is not None else []
        self.preferred = backend
        self.cache_size = cache_size
        self.stats = CompileStats()
        self.check_counts = CheckCounts()  # rows checked before any mask (ArgmaxCheck)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        # A step's fill runs here, never behind a compile that may take a second.
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self._lock = threading.Lock()
        self._backends: dict[str, Backend] = {}
        self._tokenizer: Any = None
        # spec key -> its compiled grammar (a Future: done, or compiling in a grammar thread)
        self._cache: OrderedDict[tuple[Any, ...], Future[Any]] = OrderedDict()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use

    def start(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._pool.submit(self._make_matcher, params))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)

    # --- compile side (grammar threads) ----------------------------------------------------
    def _make_matcher(self, params: StructuredOutputsParams) -> Matcher:
        if params.backend is None:
            params = choose_backend(params, self.preferred)
        assert params.backend is not None
        backend = self._backend(params.backend)
        return backend.matcher(self.compiled(params, backend))

    def compiled(self, params: StructuredOutputsParams, backend: Backend) -> Any:
        """The compiled grammar of `params`: cached, being compiled by another grammar thread
        (requests of one spec that arrive together, as n > 1 samples do, compile it once), or
        compiled here. A failed compile is not cached: the spec is tried again next time."""
        key = (backend.name, *params.key)
        with self._lock:
            entry = self._cache.get(key)
            compile_here = entry is None
            if entry is None:
                entry = self._cache[key] = Future()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if not compile_here:
            return entry.result()  # waits while another grammar thread compiles it
        start = time.perf_counter()
        try:
            compiled = backend.compile(params)
        except BaseException as e:
            with self._lock:
                if self._cache.get(key) is entry:
                    del self._cache[key]
            entry.set_exception(e)
            raise
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds.append(time.perf_counter() - start)
        entry.set_result(compiled)
        return compiled

    def _backend(self, name: str) -> Backend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    from engine.model.loader import load_tokenizer

                    self._tokenizer = load_tokenizer(self.tokenizer_path)
                made: Backend = _BACKENDS[name](self._tokenizer, self.vocab_size,
                                                self.stop_token_ids)
                self._backends[name] = backend = made
            return backend

    # --- step side -------------------------------------------------------------------------
    def fill(self, matchers: list[Matcher], additive: bool, in_thread: bool) -> Future[StepMask]:
        """`bitmask(matchers)`, with `additive` also the additive mask of the CPU apply. With
        `in_thread`, in the fill thread, so it overlaps the model's forward (the caller leaves
        the matchers alone until the future is done); else here, now (a failure is raised by the
        future's result, as from the thread)."""
        if in_thread:
            return self._fill_pool.submit(self._fill, matchers, additive)
        done: Future[StepMask] = Future()
        try:
            done.set_result(self._fill(matchers, additive))
        except Exception as e:
            done.set_exception(e)
        return done

    def argmax_check(self, req_ids: list[str], greedy: list[bool],
                     matchers: list[XgrammarMatcher]) -> ArgmaxCheck:
        """Rows masked only when their grammar refuses their unmasked choice; a refused row's
        bitmask is filled here, on the step's thread, when the sampler asks."""
        return ArgmaxCheck(req_ids, greedy, matchers, lambda refused: self._fill(refused, False),
                           self.check_counts)

    def _fill(self, matchers: list[Matcher], additive: bool) -> StepMask:
        bitmask = self.bitmask(matchers)
        return StepMask(bitmask, additive_mask(bitmask, self.vocab_size) if additive else None)

    def bitmask(self, matchers: list[Matcher]) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32: bit t % 32 of word t // 32 is set where token
        t is allowed next. xgrammar rows are filled together (its batch matcher)."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        xgr_rows = [(row, m) for row, m in enumerate(matchers) if isinstance(m, XgrammarMatcher)]
        if xgr_rows:
            self._fill_xgrammar(bitmask, xgr_rows)
        for row, m in enumerate(matchers):
            if isinstance(m, GuidanceMatcher):
                m.fill_bitmask(bitmask, row)
        return bitmask

    def _fill_xgrammar(self, bitmask: torch.Tensor, rows: list[tuple[int, XgrammarMatcher]]) -> None:
        if len(rows) == 1:
            row, m = rows[0]
            m.inner.fill_next_token_bitmask(bitmask, row)
            return
        import xgrammar as xgr

        if self._batch is None:
            # One thread: the fill already runs beside the forward, and on 16 JSON-schema rows
            # of the default model one thread took 5.6 ms of CPU a step, "auto" 9.6 ms.
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask([m.inner for _, m in rows], bitmask,
                                                  indices=[r for r, _ in rows])
