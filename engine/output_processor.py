"""Front-end output processing (vLLM's `OutputProcessor`): core token outputs -> RequestOutputs.

Per request it detokenizes incrementally, decodes logprobs, matches stop strings (vLLM
semantics: the text is cut at the stop string, which is kept only with
`include_stop_str_in_output`; finish_reason "stop", stop_reason the string) and aggregates the
samples of n > 1 requests. Requests ended here by a stop string are returned so that the
caller aborts them in the core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import EngineCoreOutput, EngineCoreRequest, LogprobsEntry
from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from engine.sampling_params import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    """Hands a request's outputs to its async consumer; never grows when the consumer lags.

    A pending CUMULATIVE output is replaced by the newer one, pending DELTA outputs are merged.
    An exception put here is raised by `get()`.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if (isinstance(item, RequestOutput) and isinstance(pending, RequestOutput)
                and self.output_kind == RequestOutputKind.DELTA):
            item = _merge_delta(pending, item)
        elif isinstance(pending, BaseException):
            return  # an error stays the last word
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._pending is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._pending is None else self._take()

    def _take(self) -> RequestOutput:
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]  # outputs of requests without a collector
    reqs_to_abort: list[str]  # core request ids the core must abort (stop strings matched)


@dataclass
class _SampleState:
    """One sample (one core request) of a user request."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    text: str = ""  # decoded text, cut at a matched stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text_len(self) -> int:
        """Text that may be released now: holds back a possible stop-string prefix."""
        hold = _stop_hold_back(self.params)
        if self.finished or hold == 0:
            return len(self.text)
        return max(self.num_sent_chars, len(self.text) - hold)

    def to_completion(self, delta: bool) -> CompletionOutput:
        end = self.visible_text_len()
        start_chars = self.num_sent_chars if delta else 0
        start_tokens = self.num_sent_tokens if delta else 0
        logprobs = None if self.logprobs is None else self.logprobs[start_tokens:]
        out = CompletionOutput(
            index=self.index, text=self.text[start_chars:end],
            token_ids=self.token_ids[start_tokens:], cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        self.num_sent_chars, self.num_sent_tokens = end, len(self.token_ids)
        return out


@dataclass
class _RequestState:
    """One user request: its prompt and its samples (core request id -> sample)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: dict[str, _SampleState]
    collector: RequestOutputCollector | None
    metrics: RequestMetrics
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples.values())

    def make_output(self, changed: set[int]) -> RequestOutput | None:
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        samples = sorted(self.samples.values(), key=lambda s: s.index)
        if delta:
            samples = [s for s in samples if s.index in changed]
        prompt_logprobs = None if delta and self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_completion(delta) for s in samples], finished=finished,
            metrics=self.metrics, num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params, prompt_logprobs=prompt_logprobs)


class OutputProcessor:
    """Tracks the running requests of one front end and builds their outputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._samples: dict[str, tuple[_RequestState, _SampleState]] = {}  # by core request id

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        core_requests: list[EngineCoreRequest],
        params: SamplingParams,
        collector: RequestOutputCollector | None = None,
    ) -> None:
        """Starts tracking a user request and its core requests (from `Processor`)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        samples = {
            r.request_id: _SampleState(
                index=i, params=r.sampling_params,
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i, r in enumerate(core_requests)
        }
        arrival = core_requests[0].arrival_time if core_requests else time.time()
        state = _RequestState(
            request_id=request_id, prompt=prompt,
            prompt_token_ids=list(core_requests[0].prompt_token_ids) if core_requests else [],
            output_kind=params.output_kind, samples=samples, collector=collector,
            metrics=RequestMetrics(arrival_time=arrival))
        self._requests[request_id] = state
        for core_id, sample in samples.items():
            self._samples[core_id] = (state, sample)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> OutputProcessorOutput:
        """Applies one step's core outputs; outputs go to collectors or are returned."""
        reqs_to_abort: list[str] = []
        changed: dict[str, set[int]] = {}
        for out in outputs:
            entry = self._samples.get(out.request_id)
            if entry is None:
                continue  # aborted here while the core was stepping
            state, sample = entry
            if self._update_sample(state, sample, out):
                reqs_to_abort.append(out.request_id)
            if sample.finished:
                del self._samples[out.request_id]
            changed.setdefault(state.request_id, set()).add(sample.index)
        request_outputs: list[RequestOutput] = []
        for request_id, indices in changed.items():
            state = self._requests[request_id]
            request_output = state.make_output(indices)
            if state.finished:
                del self._requests[request_id]
            if request_output is None:
                continue
            if state.collector is not None:
                state.collector.put(request_output)
            else:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stops tracking user requests; returns the core ids of their unfinished samples.

        A consumer waiting on a collector gets a final output with finish_reason "abort".
        """
        core_ids: list[str] = []
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            for core_id, sample in state.samples.items():
                if not sample.finished:
                    sample.finish_reason = "abort"
                    core_ids.append(core_id)
                    self._samples.pop(core_id, None)
            state.metrics.finished_time = time.time()
            request_output = state.make_output(set(range(len(state.samples))))
            if state.collector is not None and request_output is not None:
                state.collector.put(request_output)
        return core_ids

    def propagate_error(self, error: BaseException) -> None:
        """Raises `error` in every waiting consumer and forgets all requests."""
        for state in self._requests.values():
            if state.collector is not None:
                state.collector.put(error)
        self._requests.clear()
        self._samples.clear()

    def _update_sample(self, state: _RequestState, sample: _SampleState,
                       out: EngineCoreOutput) -> bool:
        """Adds the output to the sample; True when a stop string ended it here. Several tokens
        (speculative decoding's) with stop strings are added one by one: a stop string ends the
        sample at the token that completes it, and the tokens after it are dropped, as without
        speculation."""
        if len(out.new_token_ids) > 1 and sample.params.stop:
            for piece in _one_token_each(out):
                if self._update_sample(state, sample, piece):
                    return True
                if sample.finished:
                    return False
            return False
        now = time.time()
        if out.new_token_ids and not state.metrics.first_token_time:
            state.metrics.first_token_time = now
        sample.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [None, *map(self._decode_logprobs, out.prompt_logprobs)]
        if sample.logprobs is not None and out.new_logprobs:
            self._add_logprobs(sample, out.new_logprobs)
        old_len = len(sample.text)
        sample.text += sample.detokenizer.update(out.new_token_ids, finished=out.finished)
        # Stop strings are matched on held-back text too (a partial character at the end):
        # ending the request here flushes that text anyway.
        candidate = sample.text + sample.detokenizer.pending_text
        stop = find_stop_string(candidate, old_len, sample.params.stop,
                                sample.params.include_stop_str_in_output)
        if stop is not None:
            stop_str, cut = stop
            sample.text = candidate[:cut]
            sample.finish_reason, sample.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = str(out.finish_reason), out.stop_reason
        if sample.finished:
            self._finish_metrics(state, out, now)
        return stop is not None and not out.finished

    def _finish_metrics(self, state: _RequestState, out: EngineCoreOutput, now: float) -> None:
        if out.times is not None:
            state.metrics = RequestMetrics.from_times(out.times)
            state.num_cached_tokens = out.times.num_cached_tokens
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if not state.metrics.finished_time:
            state.metrics.finished_time = now

    def _add_logprobs(self, sample: _SampleState, entries: list[LogprobsEntry]) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        for entry in entries:
            sample.logprobs.append(self._decode_logprobs(entry))
            sample.cumulative_logprob += entry.logprobs[0]


    def _decode_logprobs(self, entry: LogprobsEntry) -> dict[int, Logprob]:
        """The sampled token (at its rank) first, then the top-n at ranks 1..n."""
        result = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.sampled_rank,
                                              decode_token(self.tokenizer, entry.token_ids[0]))}
        for rank, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:],
                                             strict=True), start=1):
            result.setdefault(tid, Logprob(lp, rank, decode_token(self.tokenizer, tid)))
        return result


def _one_token_each(out: EngineCoreOutput) -> list[EngineCoreOutput]:
    """The output as one output per token; the last one carries the end and its details."""
    n = len(out.new_token_ids)
    pieces = []
    for i, token in enumerate(out.new_token_ids):
        last = i == n - 1
        pieces.append(EngineCoreOutput(
            out.request_id, [token], None if out.new_logprobs is None else out.new_logprobs[i:i + 1],
            finish_reason=out.finish_reason if last else None,
            stop_reason=out.stop_reason if last else None, times=out.times if last else None,
            kv_transfer_params=out.kv_transfer_params if last else None,
            prompt_logprobs=out.prompt_logprobs if i == 0 else None))
    return pieces


def find_stop_string(text: str, num_checked: int, stop: list[str],
                     include_stop_str: bool) -> tuple[str, int] | None:
    """Earliest stop string that ends after `text[:num_checked]`: (the string, where to cut).

    Text before `num_checked` was searched before, so only matches that end in the new text count.
    """
    if not stop or len(text) == num_checked:
        return None
    best: tuple[str, int] | None = None
    best_at = len(text)
    for s in stop:
        at = text.find(s, max(0, num_checked - len(s) + 1))
        if at != -1 and at < best_at:
            best, best_at = (s, at + len(s) if include_stop_str else at), at
    return best


def _stop_hold_back(params: SamplingParams) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def _merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        logprobs = None if prev.logprobs is None else prev.logprobs + (c.logprobs or [])
        by_index[c.index] = CompletionOutput(
            index=c.index, text=prev.text + c.text, token_ids=prev.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
    new.outputs = [by_index[i] for i in sorted(by_index)]
    if new.prompt_logprobs is None:
        new.prompt_logprobs = old.prompt_logprobs
    return new
