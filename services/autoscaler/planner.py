"""The SLO planner: every interval, from what was measured, how many prefill and how many decode
workers there should be. Pure logic (no I/O): the loop that feeds it and the actuators that apply
its decisions live in loop.py and actuators.py.

Prefill is sized from work: the incoming prompt-token rate against what one prefill worker
processes per second (measured while it was busy, or the configured estimate until then), at
`prefill_utilization` so queues stay short; and from the outcome: a TTFT p90 over its target adds a
worker even when the rate model says enough.
Decode is sized from the outcome and concurrency: an ITL p90 over target adds a worker; the
concurrency one decode worker held while meeting the ITL target (learned) bounds how few can carry
the current running requests.

Stability: scale-up needs the condition on `up_intervals` consecutive intervals and respects
`up_cooldown_s`; scale-down needs every signal well under target (below `down_fraction` of it) for
`down_intervals` consecutive intervals, respects `down_cooldown_s`, and removes one worker at a
time (the actuator drains it). Counts stay within [min, max]. Every decision carries its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannerConfig:
    ttft_ms: float = 2000.0  # TTFT p90 target
    itl_ms: float = 200.0  # ITL p90 target
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    prefill_tokens_per_s: float = 1500.0  # one prefill worker's throughput until measured
    prefill_utilization: float = 0.7  # plan prefill capacity so workers are busy at most this much
    decode_capacity: int = 32  # requests a decode worker carries within the ITL target (until learned)
    up_intervals: int = 2  # consecutive intervals a scale-up condition must hold
    down_intervals: int = 6  # consecutive intervals every signal must be low before scaling down
    down_fraction: float = 0.5  # "low": under this fraction of the target
    up_cooldown_s: float = 20.0
    down_cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"min_{pool}/max_{pool}: need 0 <= min <= max and max >= 1, got {lo}, {hi}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("ttft_ms and itl_ms must be positive")
        if not 0 < self.prefill_utilization <= 1 or not 0 < self.down_fraction < 1:
            raise ValueError("prefill_utilization must be in (0, 1] and down_fraction in (0, 1)")
        if self.up_intervals < 1 or self.down_intervals < 1 or self.decode_capacity < 1:
            raise ValueError("up_intervals, down_intervals and decode_capacity must be >= 1")


@dataclass(frozen=True)
class Observation:
    """What was measured over the last interval (None: nothing to measure, e.g. no requests)."""

    time_s: float
    prefill_workers: int  # healthy, not draining
    decode_workers: int
    prompt_tokens_per_s: float  # prompt tokens admitted per second
    requests_per_s: float
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    prefill_waiting: int  # requests queued on prefill workers
    decode_running: int  # requests running on decode workers
    decode_waiting: int
    prefill_busy_tokens_per_s: float | None = None  # measured per-worker prefill throughput


@dataclass(frozen=True)
class Decision:
    time_s: float
    pool: str  # "prefill" | "decode"
    current: int
    target: int
    reason: str

    @property
    def delta(self) -> int:
        return self.target - self.current


@dataclass
class _PoolState:
    up_streak: int = 0
    down_streak: int = 0
    below_streak: int = 0
    last_change_s: float = -math.inf


@dataclass
class Planner:
    config: PlannerConfig = field(default_factory=PlannerConfig)
    prefill_tps: float = 0.0  # learned per-worker prefill throughput (tokens/s)
    decode_capacity: float = 0.0  # learned running requests per decode worker within the ITL target
    _state: dict[str, _PoolState] = field(default_factory=lambda: {"prefill": _PoolState(),
                                                                  "decode": _PoolState()})

    def __post_init__(self) -> None:
        self.prefill_tps = self.prefill_tps or self.config.prefill_tokens_per_s
        self.decode_capacity = self.decode_capacity or float(self.config.decode_capacity)

    def plan(self, obs: Observation) -> list[Decision]:
        """The decisions for this interval: one per pool whose count should change (often none)."""
        self._learn(obs)
        out = [self._prefill(obs), self._decode(obs)]
        return [d for d in out if d is not None]

    # --- learning ----------------------------------------------------------------------------
    def _learn(self, obs: Observation) -> None:
        if obs.prefill_busy_tokens_per_s and obs.prefill_busy_tokens_per_s > 0:
            self.prefill_tps = 0.7 * self.prefill_tps + 0.3 * obs.prefill_busy_tokens_per_s
        if obs.itl_p90_ms is not None and obs.decode_workers and obs.decode_running:
            per_worker = obs.decode_running / obs.decode_workers
            if obs.itl_p90_ms <= self.config.itl_ms and per_worker > self.decode_capacity:
                self.decode_capacity = per_worker  # it carried this many within target
            elif obs.itl_p90_ms > self.config.itl_ms and per_worker < self.decode_capacity:
                self.decode_capacity = max(1.0, per_worker)  # it could not: capacity is lower

    # --- pools -------------------------------------------------------------------------------
    def _prefill(self, obs: Observation) -> Decision | None:
        c = self.config
        n = obs.prefill_workers
        need = math.ceil(obs.prompt_tokens_per_s / (self.prefill_tps * c.prefill_utilization))
        ttft_high = obs.ttft_p90_ms is not None and obs.ttft_p90_ms > c.ttft_ms
        want_up, why_up = False, ""
        if ttft_high:
            want_up, why_up = True, f"TTFT p90 {obs.ttft_p90_ms:.0f} ms > target {c.ttft_ms:.0f} ms"
        if need > n:
            want_up = True
            why_up = (why_up + "; " if why_up else "") + (
                f"prompt load {obs.prompt_tokens_per_s:.0f} tok/s needs {need} workers at "
                f"{self.prefill_tps:.0f} tok/s each and {c.prefill_utilization:.0%} utilization")
        low = (obs.ttft_p90_ms is None or obs.ttft_p90_ms < c.down_fraction * c.ttft_ms) and \
            obs.prefill_waiting == 0 and need < n
        why_down = (f"TTFT p90 {_ms(obs.ttft_p90_ms)} under {c.down_fraction:.0%} of target, no queue, "
                    f"prompt load {obs.prompt_tokens_per_s:.0f} tok/s needs {need}")
        step_up = max(1, need - n) if need > n else 1
        return self._decide("prefill", obs.time_s, n, c.min_prefill, c.max_prefill, want_up, step_up,
                            why_up, low, why_down)

    def _decode(self, obs: Observation) -> Decision | None:
        c = self.config
        n = obs.decode_workers
        running = obs.decode_running + obs.decode_waiting
        need = math.ceil(running / self.decode_capacity) if running else 0
        itl_high = obs.itl_p90_ms is not None and obs.itl_p90_ms > c.itl_ms
        want_up, why_up = False, ""
        if itl_high:
            want_up, why_up = True, f"ITL p90 {obs.itl_p90_ms:.0f} ms > target {c.itl_ms:.0f} ms"
        if obs.decode_waiting > 0 and need > n:
            want_up = True
            why_up = (why_up + "; " if why_up else "") + (
                f"{running} requests need {need} workers at {self.decode_capacity:.0f} each")
        low = (obs.itl_p90_ms is None or obs.itl_p90_ms < c.down_fraction * c.itl_ms) and \
            obs.decode_waiting == 0 and need < n
        why_down = (f"ITL p90 {_ms(obs.itl_p90_ms)} under {c.down_fraction:.0%} of target, "
                    f"{running} requests fit on {max(need, 1)}")
        return self._decide("decode", obs.time_s, n, c.min_decode, c.max_decode, want_up,
                            max(1, need - n) if need > n else 1, why_up, low, why_down)

    def _decide(self, pool: str, now: float, n: int, lo: int, hi: int, want_up: bool, step_up: int,
                why_up: str, low: bool, why_down: str) -> Decision | None:
        c, st = self.config, self._state[pool]
        if n < lo:  # below the minimum (a worker died, not just one late report): restore
            st.below_streak += 1
            st.up_streak = st.down_streak = 0
            if st.below_streak < c.up_intervals:
                return None
            st.last_change_s, st.below_streak = now, 0
            return Decision(now, pool, n, lo, f"below the minimum of {lo}")
        st.below_streak = 0
        if n > hi:
            st.last_change_s = now
            return Decision(now, pool, n, hi, f"above the maximum of {hi}")
        st.up_streak = st.up_streak + 1 if want_up else 0
        st.down_streak = st.down_streak + 1 if (low and not want_up) else 0
        cooled_up = now - st.last_change_s >= c.up_cooldown_s
        if want_up and n < hi and st.up_streak >= c.up_intervals and cooled_up:
            st.last_change_s, st.up_streak = now, 0
            return Decision(now, pool, n, min(hi, n + step_up), why_up)
        if st.down_streak >= c.down_intervals and n > lo and now - st.last_change_s >= c.down_cooldown_s:
            st.last_change_s, st.down_streak = now, 0
            return Decision(now, pool, n, n - 1, why_down)
        return None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"
