"""Plain messages between the engine's parts: ids, counts and token lists, never tensors.

- `EngineCoreRequest` / `EngineCoreOutput(s)`: front end <-> engine core (msgspec-encodable,
  they cross the ZMQ boundary when the core runs in its own process).
- `SchedulerOutput`: scheduler -> model runner, what to compute this step.
- `ModelRunnerOutput`: model runner -> scheduler, what was sampled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
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
    block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass
class CachedRequestData:
    """A request the runner already holds, continuing from the last step."""

    req_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # before this step


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


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step. Requests still in prefill get an empty list."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # same order as req_ids
    logprobs: list[LogprobsEntry | None] = field(default_factory=list)  # same order, or empty
    kv_connector_output: Any = None  # engine.connector.base.KVConnectorOutput, or None


@dataclass
class EngineStats:
    """A snapshot of the engine's queues and KV cache."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int  # usable blocks (the null block excluded)
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    block_size: int = 16
    max_model_len: int = 0
