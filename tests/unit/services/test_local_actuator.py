"""Workers the local autoscaler starts get the same flags as those `pdserve up` started: the
shared engine flags for every role, the prefill-only ones (scheduling policy, step budget) for
prefill workers only."""

from __future__ import annotations

from services.autoscaler.actuators import LocalProcessActuator
from services.cli import build_parser
from services.up.specs import prefill_args


def test_role_flags_go_to_that_role_only() -> None:
    act = LocalProcessActuator(["--model", "m"], role_args={"prefill": ["--scheduling-policy", "fcfs"]})
    base = ["worker", "--role"]
    assert act.argv("prefill", 5) == [*base, "prefill", "--host", "127.0.0.1", "--port", "5",
                                      "--model", "m", "--scheduling-policy", "fcfs"]
    assert act.argv("decode", 6) == [*base, "decode", "--host", "127.0.0.1", "--port", "6",
                                     "--model", "m"]


def test_up_prefill_flags_become_worker_flags() -> None:
    args = build_parser().parse_args(["up", "--prefill-scheduling-policy", "fcfs",
                                      "--prefill-max-num-batched-tokens", "2048"])
    assert prefill_args(args) == ["--max-num-batched-tokens", "2048", "--scheduling-policy", "fcfs"]
    assert prefill_args(build_parser().parse_args(["up"])) == []  # the workers' own defaults
