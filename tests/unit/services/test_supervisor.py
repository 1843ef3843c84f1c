"""The supervisor with plain child processes: a child that exits is restarted after a growing
backoff and logged, one past its restart budget stays down (a critical one stops everything),
children stopped on purpose are not restarted, the state file follows, readiness checks see the
instance id of the process they are about."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from services.procs import INSTANCE_ENV
from services.supervisor import ChildSpec, FatalChildError, RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
FAST = RestartPolicy(budget=2, window_s=30, backoff_s=0.1, max_backoff_s=0.4, stable_s=30)


def watch_until(sup: Supervisor, done: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        sup.watch()
        time.sleep(0.02)


def test_an_exited_child_is_restarted_with_backoff_until_its_budget_is_spent(tmp_path: Path) -> None:
    logs: list[str] = []
    state = tmp_path / "state.json"
    sup = Supervisor(FAST, log=logs.append, state_file=state)
    child = sup.start(ChildSpec("w", "decode", SLEEPER, ready=lambda _: True))
    try:
        sup.wait_ready("w", time.monotonic() + 10)
        pids = [child.pid]
        for n in (1, 2):
            child.proc.kill()
            watch_until(sup, lambda: child.state == "starting" and child.pid not in pids)
            pids.append(child.pid)
            assert f"exited with signal SIGKILL; restarting it in {0.1 * 2 ** (n - 1):.1f} s" in logs[-2]
            assert logs[-1] == f"w restarted (pid {child.pid})"
            watch_until(sup, lambda: child.state == "running")
            assert "serves again" in logs[-1]
        snapshot = json.loads(state.read_text())["components"][0]
        assert snapshot["pid"] == child.pid and snapshot["restarts"] == 2 and snapshot["state"] == "running"
        child.proc.kill()  # a third exit within the window: the budget (2) is spent
        watch_until(sup, lambda: child.state == "failed")
        assert "restart budget spent" in logs[-1]
        time.sleep(0.3)
        sup.watch()
        assert child.proc.poll() is not None and child.state == "failed"
    finally:
        sup.stop_all([])


def test_a_critical_child_past_its_budget_stops_everything() -> None:
    sup = Supervisor(RestartPolicy(budget=0, backoff_s=0.1), log=lambda _: None)
    child = sup.start(ChildSpec("router", "router", SLEEPER, ready=lambda _: True, critical=True))
    try:
        child.proc.kill()
        child.proc.wait(5)
        with pytest.raises(FatalChildError, match="router"):
            sup.watch()
    finally:
        sup.stop_all([])


def test_children_stopped_on_purpose_are_not_restarted() -> None:
    sup = Supervisor(FAST, log=lambda _: None)
    a = sup.start(ChildSpec("a", "prefill", SLEEPER, ready=lambda _: True))
    b = sup.start(ChildSpec("b", "decode", SLEEPER, ready=lambda _: True))
    sup.stop("a", timeout_s=5)
    assert a.proc.returncode is not None and a.state == "stopped"
    sup.watch()
    assert a.state == "stopped"
    sup.stop_all([["decode"]], timeout_s=5)
    assert b.proc.returncode is not None
    sup.watch()
    assert {c.state for c in sup.children()} == {"stopped"}


def test_readiness_is_checked_against_the_instance_id_the_child_was_given(tmp_path: Path) -> None:
    out = tmp_path / "id"
    script = f"import os, time; open({str(out)!r}, 'w').write(os.environ[{INSTANCE_ENV!r}]); time.sleep(60)"
    seen: list[str] = []

    def ready(instance: str) -> bool:
        seen.append(instance)
        return out.exists() and out.read_text() == instance

    sup = Supervisor(FAST, log=lambda _: None)
    child = sup.start(ChildSpec("c", "kvstore", [sys.executable, "-c", script], ready=ready))
    try:
        sup.wait_ready("c", time.monotonic() + 10, poll_s=0.05)
        assert seen[-1] == child.instance == out.read_text()
        with pytest.raises(RuntimeError, match="exited"):
            child.proc.kill()
            out.unlink()
            child.proc.wait(5)
            sup.wait_ready("c", time.monotonic() + 10, poll_s=0.05)
    finally:
        sup.stop_all([])


def test_restart_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="budget"):
        RestartPolicy(budget=-1)
    with pytest.raises(ValueError, match="backoff_s"):
        RestartPolicy(backoff_s=0)


def test_a_running_child_that_stops_answering_its_liveness_check_is_killed_and_restarted() -> None:
    logs: list[str] = []
    answers = [True]
    policy = RestartPolicy(budget=2, backoff_s=0.1, unresponsive_s=0.3, liveness_every_s=0.05)
    sup = Supervisor(policy, log=logs.append)
    child = sup.start(ChildSpec("w", "decode", SLEEPER, ready=lambda _: True, alive=lambda: answers[0]))
    try:
        sup.wait_ready("w", time.monotonic() + 10)
        sup.start_liveness()
        first = child.pid
        for _ in range(10):  # answering: left alone
            sup.watch()
            time.sleep(0.05)
        assert child.pid == first and child.state == "running"
        answers[0] = False  # hung
        watch_until(sup, lambda: child.pid != first and child.state == "starting")
        assert any("has not answered its liveness check" in line for line in logs)
        answers[0] = True
        watch_until(sup, lambda: child.state == "running")
    finally:
        sup.stop_all([])
