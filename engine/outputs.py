"""What the engine's front end returns to users (vLLM's `RequestOutput` family).

Built by the output processor from the engine core's token-level `EngineCoreOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import RequestTimes


@dataclass
class Logprob:
    """Log probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = most likely token of the distribution
    decoded_token: str | None = None


# One dict per generated position: token id -> its Logprob (the sampled token and the top-n).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has none


@dataclass
class CompletionOutput:
    """One sample of a request. With DELTA output, `text` / `token_ids` hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.time() seconds) and counters of one request."""

    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    # KV a connector moved for it (engine/core/outputs.py RequestTimes)
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_load_end_time: float = 0.0
    kv_save_bytes: int = 0
    kv_save_seconds: float = 0.0
    kv_save_end_time: float = 0.0

    @classmethod
    def from_times(cls, times: RequestTimes) -> RequestMetrics:
        return cls(
            arrival_time=times.arrival_time,
            first_scheduled_time=times.first_scheduled_time,
            first_token_time=times.first_token_time,
            finished_time=times.finished_time,
            num_cached_tokens=times.num_cached_tokens,
            num_preemptions=times.num_preemptions,
            num_generated_tokens=times.num_generated_tokens,
            kv_load_bytes=times.kv_load_bytes, kv_load_seconds=times.kv_load_seconds,
            kv_load_end_time=times.kv_load_end_time, kv_save_bytes=times.kv_save_bytes,
            kv_save_seconds=times.kv_save_seconds, kv_save_end_time=times.kv_save_end_time,
        )

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds, once the first token is known."""
        if not self.first_token_time or not self.arrival_time:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if not self.finished_time or not self.arrival_time:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one user request: its prompt and one `CompletionOutput` per sample.

    `finished` is True on the last output of the request (all samples done). `prompt` is the
    text prompt (the templated text for chat), None for token-id prompts.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from a KV connector, on the final output
    # With prompt_logprobs: None for the first prompt token, then each one's logprobs (the
    # prompt token first, then the top-n). DELTA outputs carry it once, CUMULATIVE ones always.
    prompt_logprobs: PromptLogprobs | None = None
