"""The engine core's view of one request (pure Python)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from engine.core.outputs import EngineCoreRequest, FinishReason, LogprobsEntry, RequestTimes
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.manager import GrammarState


class RequestStatus(enum.IntEnum):
    WAITING_FOR_FSM = -1  # its structured-output grammar is compiling
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Tokens known so far (`num_tokens`) and how many have KV computed (`num_computed_tokens`).

    `block_hashes` holds the prefix-cache hash of every full block of `all_token_ids`; the KV
    cache manager extends it as tokens arrive.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        num_prior_outputs: int = 0,
        cache_salt: str | None = None,
        await_first_token: bool = False,
    ) -> None:
        """`num_prior_outputs`: how many of the given token ids (at the end) are earlier outputs
        of this sample, continued here (EngineCoreRequest.num_prior_outputs). `cache_salt`
        enters the first block's hash, so only requests of the same salt share blocks."""
        split = len(prompt_token_ids) - num_prior_outputs
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids[:split])
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(prompt_token_ids[split:])
        self.num_prior_outputs = num_prior_outputs
        self.cache_salt = cache_salt
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.times = RequestTimes(arrival_time=arrival_time)
        self.max_tokens = sampling_params.max_tokens
        self.kv_transfer_params: dict[str, Any] | None = None  # set by a connector at the end
        self.prompt_logprobs: list[LogprobsEntry] = []  # prompt positions 1.. so far (if asked)
        self.grammar: GrammarState | None = None  # with structured_outputs (set by the engine core)
        # Dispatched beside its prefill: never computed here before `add_first_token`.
        self.awaiting_first_token = await_first_token
        self.spec_token_ids: list[int] = []  # drafts proposed for its next step

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                   req.eos_token_id, req.arrival_time, req.priority, req.num_prior_outputs,
                   req.cache_salt, req.await_first_token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs of the sample, prior ones included (what max_tokens and min_tokens count)."""
        return len(self.output_token_ids)

    @property
    def num_new_output_tokens(self) -> int:
        """Outputs produced here."""
        return len(self.output_token_ids) - self.num_prior_outputs

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def add_first_token(self, token_id: int) -> None:
        """The prefill's first token of a request that awaited it: a prior output from now."""
        assert self.awaiting_first_token and not self.output_token_ids
        self.awaiting_first_token = False
        self.num_prior_outputs = 1
        self.append_output_token_ids([token_id])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
