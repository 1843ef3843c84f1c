"""What the dispatcher (dispatcher.py) is configured with, what it streams, and one sample's
decode state from attempt to attempt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from services.router.dispatch.pool import Policy, PoolOptions, PrefixSource
from services.worker.auth import WorkerAccess
from services.worker.client import PositionLogprobs


class NoWorkerError(Exception):
    """No healthy worker in a pool the request needs."""


@dataclass(frozen=True)
class DispatchOptions:
    prefill: tuple[str, ...] = ()  # empty = colocated mode
    decode: tuple[str, ...] = ()
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0  # the whole decode of a sample, migrations included
    load_timeout_s: float = 1.0
    refresh_s: float = 0.1  # how often worker load and health are refreshed
    prefill_attempts: int = 2  # prefill workers tried before the decode worker computes the prompt
    prefill_policy: Policy = "prefix_aware"
    decode_policy: Policy = "prefix_aware"
    local_prefill_tokens: int = 0  # uncached prompt tokens the decode worker computes itself; 0 = off
    block_size: int = 16
    prefix_index: PrefixSource = "events"  # KV events where workers publish them (dispatch/pool.py)
    stall_timeout_s: float = 5.0  # a decode stream silent this long moves to another worker
    max_migrations: int = 3  # per sample
    migration_wait_s: float = 60.0  # how long a migrating sample waits for a serving worker
    early_handoff: bool = True  # the decode call goes out with the prefill (module docstring)
    worker_access: WorkerAccess | None = None  # worker token and TLS files; None = from the env

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("decode: at least one decode (or colocated) worker is needed")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts: must be at least 1, got {self.prefill_attempts}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: must be >= 0, got {self.local_prefill_tokens}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {self.max_migrations}")
        for name in ("prefill_timeout_s", "decode_timeout_s", "load_timeout_s", "refresh_s",
                     "stall_timeout_s", "migration_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    def pool_options(self, policy: Policy) -> PoolOptions:
        return PoolOptions(policy=policy, refresh_s=self.refresh_s, load_timeout_s=self.load_timeout_s,
                           block_size=self.block_size, access=self.worker_access,
                           prefix_index=self.prefix_index)


@dataclass
class Step:
    """New tokens of one sample; the last step has finish_reason set (and usage from the worker).
    A step with neither tokens nor finish_reason, first if at all, says a worker has accepted the
    sample: its prompt is being computed (a streamed response can start there)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # with the first token

    @property
    def accepted(self) -> bool:
        return not self.token_ids and not self.finish_reason


@dataclass
class _Sample:
    """One sample's decode: what the next attempt starts from."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the whole sample's
    kv: dict[str, Any] | None
    hashes: Sequence[bytes]
    deadline: float
    priority: int = 0
    cache_salt: str = ""
    generated: list[int] = field(default_factory=list)  # tokens already streamed to the caller
    migrations: int = 0
    failed: dict[str, float] = field(default_factory=dict)  # worker -> when the sample failed there

    def next_call(self) -> tuple[str, list[int]]:
        """Request id and token ids of the next attempt: the prompt and the outputs so far
        (the worker is told how many of them are outputs, and gets the sample's params)."""
        rid = self.request_id if self.migrations == 0 else f"{self.request_id}-m{self.migrations}"
        return rid, [*self.prompt_ids, *self.generated]
