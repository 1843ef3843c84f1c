"""The chaos runner's fault schedule: every default fault parses, every kind of component is
struck by each action that applies to it, and a bad fault is refused before anything starts."""

from __future__ import annotations

import pytest

from loadtest.chaos import DEFAULT_FAULTS, parse_args
from loadtest.chaos_system import Fault


def test_the_default_schedule_covers_every_component_kind_and_action() -> None:
    faults = [Fault.parse(f) for f in DEFAULT_FAULTS.split(",")]
    kinds = {f.target.split(":")[0].split("-")[0] for f in faults}
    assert kinds == {"prefill", "decode", "core", "kvstore", "router"}
    for kind in ("prefill", "decode", "kvstore", "router"):
        assert {f.action for f in faults if f.target.startswith(kind)} == {"kill", "freeze", "restart"}
    assert {f.action for f in faults if f.target.startswith("core")} == {"kill", "freeze"}
    assert len(faults) >= 6


@pytest.mark.parametrize("text", ["kill:stor", "restart:core:decode", "kill:core:x", "zap:router", "kill:"])
def test_bad_faults_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="fault"):
        Fault.parse(text)


def test_store_is_an_alias_and_runs_are_bounded() -> None:
    assert Fault.parse("freeze:store") == Fault("freeze", "kvstore")
    args = parse_args([])
    assert args.max_requests > args.min_requests >= 200 and args.max_duration_s > 0
    assert args.request_timeout_s > 0 and args.prefill == args.decode == 2
