"""Plain messages between the engine's parts: ids, counts and token lists, never tensors.

- `EngineCoreRequest` / `EngineCoreOutput(s)`: front end <-> engine core (msgspec-encodable,
  they cross the ZMQ boundary when the core runs in its own process).
- `SchedulerOutput`: scheduler -> model runner, what to compute this step.
- `ModelRunnerOutput`: model runner -> scheduler, what was sampled.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; `str()` gives the OpenAI API's word."""

    STOP = 0  # a stop token or stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client or the front end

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it: already tokenized, one sample (n == 1)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    # The last `num_prior_outputs` of prompt_token_ids are this sample's earlier outputs (the
    # prefill worker's first token, tokens streamed before a migration): the core continues the
    # sample as if it had produced them (seeded draws by output position, penalties, min_tokens
    # and max_tokens count them).
    num_prior_outputs: int = 0
    # Tenant isolation (vLLM's cache_salt): requests share prefix-cache blocks and KV-store
    # chunks only with requests of the same salt. None = unsalted.
    cache_salt: str | None = None
    # Early hand-off (a decode dispatched beside its prefill): prompt_token_ids are the prompt
    # only; the core allocates its blocks and loads the prompt's KV (do_remote_prefill) as the
    # producer saves it, and computes nothing until `EngineCore.add_first_token` gives it the
    # prefill's sampled first token (then a prior output, as with num_prior_outputs=1).
    await_first_token: bool = False


@dataclass
class FirstToken:
    """The prefill's first token for a request added with await_first_token, and the
    producer's kv_transfer_params (its keys, so the consumer can release its lease)."""

    request_id: str
    token_id: int
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class LogprobsEntry:
    """Logprobs of one sampled position: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # rank of the sampled token in the distribution (1 = most likely)


@dataclass
class RequestTimes:
    """Per-request timestamps (time.time() seconds) and counters, filled by the core."""

    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    last_token_time: float = 0.0  # of the last step that gave it tokens
    num_generated_tokens: int = 0  # by this engine (not outputs it was given to continue from)
    # KV moved by a connector for it: loaded (bytes, seconds of the load), saved (bytes, and the
    # seconds its steps' saves were in flight, first layer queued to the last sent)
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_save_bytes: int = 0
    kv_save_seconds: float = 0.0
    kv_load_end_time: float = 0.0  # when the engine learned the load ended (time.time())
    kv_save_end_time: float = 0.0  # ... its last step's saves ended


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step (and its end, when `finish_reason` is set)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    times: RequestTimes | None = None  # set on the final output
    kv_transfer_params: dict[str, Any] | None = None  # set on the final output by a connector
    # With prompt_logprobs: on the output with the request's first new token, one entry per
    # prompt position after the first (the prompt token there first, then the top-n).
    prompt_logprobs: list[LogprobsEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (all its tokens)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group (engine/core/kv_layout.py)
    num_computed_tokens: int  # before this step
    cache_salt: str | None = None  # only requests of the same salt share KV (a connector's keys)


@dataclass
class CachedRequestData:
    """A request the runner already holds, continuing from the last step."""

    req_id: str
    new_block_ids: list[list[int]]  # per KV cache group, appended to its block table
    num_computed_tokens: int  # before this step
    # Per group: the blocks the request still holds before `new_block_ids` (the scheduler freed
    # blocks that only rejected drafts had filled); None: all it held.
    num_kept_blocks: list[int] | None = None


@dataclass
class SchedulerOutput:
    """What one step computes. Order of `num_scheduled_tokens` is the batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> new tokens this step, in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)  # their blocks are gone
    num_common_prefix_blocks: int = 0
    kv_connector_metadata: object | None = None
    # Requests with structured outputs that sample this step, in batch order: the engine core
    # fills their grammar bitmask rows.
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: req_id -> the draft tokens scheduled after its last known token (its
    # scheduled tokens count them: 1 + len(drafts))
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step. Requests still in prefill get an empty list."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # same order as req_ids (several with drafts kept)
    # same order, or empty: per request, an entry per sampled token, or None
    logprobs: list[list[LogprobsEntry] | None] = field(default_factory=list)
    kv_connector_output: Any = None  # engine.connector.base.KVConnectorOutput, or None
    # Requests with prompt_logprobs whose prompt positions ran this step: req_id -> (j, entries),
    # entries[k] for the prompt token at j + 1 + k (predicted at position j + k).
    prompt_logprobs: dict[str, tuple[int, list[LogprobsEntry]]] = field(default_factory=dict)
    # Speculative decoding: req_id -> drafts proposed for its next step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0)
KV_TRANSFER_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets (vllm/v1/metrics/loggers.py) for the histograms of the same names.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


@dataclass
class Histogram:
    """Observations counted in fixed buckets since start-up (what a Prometheus histogram holds).

    `counts[i]` counts values in (bounds[i-1], bounds[i]]; the last entry counts values above
    the last bound. `observe` costs one bisect and three adds.
    """

    bounds: list[float]
    counts: list[int]
    total: float = 0.0  # sum of the observed values
    count: int = 0

    @classmethod
    def with_bounds(cls, bounds: tuple[float, ...] | list[float]) -> Histogram:
        return cls([float(b) for b in bounds], [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(list(self.bounds), list(self.counts), self.total, self.count)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, the last bound being +inf."""
        out, running = [], 0
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(float(mantissa * scale))
        scale *= 10


def _step_histogram() -> Histogram:
    return Histogram.with_bounds(STEP_SECONDS_BUCKETS)


def _transfer_histogram() -> Histogram:
    return Histogram.with_bounds(KV_TRANSFER_SECONDS_BUCKETS)


@dataclass
class KVTransferStats:
    """KV moved by a connector's worker half since start-up.

    A load is one request's KV arriving (every layer); a save is one put of KV objects to the
    store (one layer of a step's new chunks when streaming layers). Bytes count the KV payload.
    """

    load_seconds: Histogram = field(default_factory=_transfer_histogram)
    save_seconds: Histogram = field(default_factory=_transfer_histogram)
    load_bytes: int = 0
    save_bytes: int = 0
    load_failures: int = 0  # loads that ended short or with an error
    save_failures: int = 0  # puts the store refused or that did not reach it
    integrity_failures: int = 0  # loaded objects whose checksum did not verify (kvstore/integrity.py)

    def copy(self) -> KVTransferStats:
        return KVTransferStats(self.load_seconds.copy(), self.save_seconds.copy(), self.load_bytes,
                               self.save_bytes, self.load_failures, self.save_failures,
                               self.integrity_failures)


@dataclass
class RequestHistograms:
    """vLLM's per-request and per-step histograms, since start-up (what each one observes:
    engine/core/request_stats.py). Token counts use 1-2-5 buckets up to max_model_len."""

    queue_seconds: Histogram  # arrival -> first scheduled
    prefill_seconds: Histogram  # first scheduled -> first token
    decode_seconds: Histogram  # first token -> last token
    inference_seconds: Histogram  # first scheduled -> last token
    time_per_output_token: Histogram  # between a request's consecutive tokens
    iteration_tokens: Histogram  # prompt + generated tokens counted in one step
    prompt_tokens: Histogram
    generation_tokens: Histogram
    max_num_generation_tokens: Histogram
    params_n: Histogram

    @classmethod
    def create(cls, max_model_len: int = 4096) -> RequestHistograms:
        tokens, latency, h = buckets_1_2_5(max_model_len), REQUEST_LATENCY_BUCKETS, Histogram.with_bounds
        return cls(queue_seconds=h(latency), prefill_seconds=h(latency), decode_seconds=h(latency),
                   inference_seconds=h(latency), time_per_output_token=h(TIME_PER_OUTPUT_TOKEN_BUCKETS),
                   iteration_tokens=h(ITERATION_TOKENS_BUCKETS), prompt_tokens=h(tokens),
                   generation_tokens=h(tokens), max_num_generation_tokens=h(tokens),
                   params_n=h(PARAMS_N_BUCKETS))

    def copy(self) -> RequestHistograms:
        return RequestHistograms(*(h.copy() for h in self.all()))

    def all(self) -> list[Histogram]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass
class EngineStats:
    """A snapshot of the engine's queues and KV cache, and its counters since start-up."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int  # usable blocks (the null block excluded)
    kv_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    block_size: int = 16
    # the share of the model's layers one block holds: 1, but for a hybrid model's pages
    # (layers_per_block / num_layers, engine/core/kv_layout.py)
    block_layer_share: float = 1.0
    max_model_len: int = 0
    num_cached_blocks: int = 0  # blocks findable in the prefix cache (in use or free)
    num_prompt_tokens: int = 0  # prompts of requests that produced a first token
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    step_seconds: Histogram = field(default_factory=_step_histogram)  # steps that computed tokens
    kv_transfer: KVTransferStats | None = None  # None without a KV connector
    requests: RequestHistograms = field(default_factory=RequestHistograms.create)
    spec_decoding: SpecDecodingStats | None = None  # None without speculative decoding
    kv_events_published: int = 0  # KV event batches sent (the next one's sequence number)
    # where its KV events are published and replayed (as bound: "" when off or connecting out)
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_epoch: str = ""  # the publisher's id (new at every engine start)


@dataclass
class SpecDecodingStats:
    """vLLM's speculative-decoding counters since start-up: verifications with drafts, tokens
    drafted, drafts accepted, and accepted ones per draft position (0 = the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos))
