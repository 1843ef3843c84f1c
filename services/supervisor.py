"""Supervision of local child processes (`pdserve up`'s KV store, workers and router, and the
workers its autoscaler adds).

    sup = Supervisor(RestartPolicy(), state_file=Path("up.json"))
    sup.start(ChildSpec("decode-0", "decode", argv, ready=lambda instance: ..., target="h:p"))
    sup.wait_ready("decode-0", deadline)
    while running:
        sup.watch()          # every half second: exits, restarts, readiness
    sup.stop_all([["router"], ["prefill", "decode"], ["kvstore"]])

A child that exits while the system runs, whatever its exit code, is restarted after a backoff
(`backoff_s`, doubling up to `max_backoff_s`; back to `backoff_s` once a child ran `stable_s`),
at most `budget` times within `window_s`; every exit and restart is logged with its exit code or
signal. A restarted child keeps its name, port and arguments (a new instance id), so the router,
which keeps a worker's address in its pool, takes it back as soon as its health says SERVING.
A child whose budget is spent stays down (logged); when it is critical (the router: nothing is
served without it) `watch` raises FatalChildError and the caller stops everything. A running
child with a liveness check (`alive`) that has not answered it for `unresponsive_s` (hung,
stuck in its shutdown, stopped by a signal) is killed, and so restarted like any other exit.

Thread-safe: the autoscaler starts and stops children from its own thread; liveness checks run
in a thread of the supervisor (`start_liveness()`), so a hung child never holds `watch`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.procs import describe_exit, new_instance_id, spawn


@dataclass(frozen=True)
class RestartPolicy:
    budget: int = 5  # restarts allowed within window_s
    window_s: float = 300.0
    backoff_s: float = 0.5  # the first restart's delay, doubled for each restart after it
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # a child that ran this long starts over at backoff_s
    unresponsive_s: float = 60.0  # a running child failing its liveness check this long is killed
    liveness_every_s: float = 2.0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"restart budget: must be >= 0, got {self.budget}")
        for name in ("window_s", "backoff_s", "max_backoff_s", "stable_s", "unresponsive_s",
                     "liveness_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class ChildSpec:
    """One supervised component. `ready(instance_id)` says whether the process with that
    instance id serves (it must check the id: another process may answer on the same port)."""

    name: str  # "decode-0"
    kind: str  # "kvstore", "prefill", "decode", "colocated", "router"
    argv: Sequence[str]  # the command line (services.procs.cli(...) for a pdserve component)
    ready: Callable[[str], bool]
    target: str = ""  # host:port it serves on
    env: Mapping[str, str] | None = None
    cpus: frozenset[int] | None = None
    critical: bool = False
    alive: Callable[[], bool] | None = None  # liveness: does the process still answer at all?
    pass_fds: tuple[int, ...] = ()  # file descriptors it inherits (a listening socket)


class FatalChildError(RuntimeError):
    """A critical child's restart budget is spent."""


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    instance: str
    started: float
    state: str = "starting"  # starting -> running; backoff; failed; stopped
    exits: deque[float] = field(default_factory=deque)  # exit times within the window
    backoff: float = 0.0
    restart_at: float = 0.0
    exited_at: float | None = None
    restarts: int = 0
    answered_at: float = 0.0  # its liveness check's last success (monotonic)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


def _stderr(message: str) -> None:
    print(f"pdserve up: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, policy: RestartPolicy = RestartPolicy(),
                 log: Callable[[str], None] = _stderr, state_file: Path | None = None) -> None:
        self.policy = policy
        self.log = log
        self.state_file = state_file
        self._children: dict[str, Child] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._liveness: threading.Thread | None = None

    def start_liveness(self) -> None:
        """Checks every running child's liveness in a thread (`watch` acts on the results). The
        watch begins now: every running child counts as having answered now (a child ready long
        ago, while the others loaded, is not held to an answer it was never asked for)."""
        with self._lock:
            now = time.monotonic()
            for child in self._children.values():
                if child.state == "running":
                    child.answered_at = now
        if self._liveness is None:
            self._liveness = threading.Thread(target=self._check_liveness, name="liveness", daemon=True)
            self._liveness.start()

    def _check_liveness(self) -> None:
        while not self._closing.wait(self.policy.liveness_every_s):
            for child in self.children():
                if child.state == "running" and child.spec.alive is not None and child.spec.alive():
                    child.answered_at = time.monotonic()

    # --- starting ---------------------------------------------------------------------------
    def start(self, spec: ChildSpec) -> Child:
        with self._lock:
            if spec.name in self._children and self._children[spec.name].state != "stopped":
                raise ValueError(f"a child named {spec.name} is already supervised")
            child = Child(spec, *self._spawn(spec), backoff=self.policy.backoff_s)
            self._children[spec.name] = child
            self._write_state()
            return child

    def _spawn(self, spec: ChildSpec) -> tuple[subprocess.Popen[bytes], str, float]:
        instance = new_instance_id()
        # A process group of its own: a terminal's Ctrl-C reaches the supervisor only, which
        # stops the children in order (the router before the workers it calls).
        proc = spawn(list(spec.argv), env=spec.env, cpus=set(spec.cpus) if spec.cpus else None,
                     instance=instance, pass_fds=spec.pass_fds, process_group=0)
        return proc, instance, time.monotonic()

    def wait_ready(self, name: str, deadline: float, poll_s: float = 0.2,
                   stop: threading.Event | None = None) -> None:
        """Blocks until the child serves; RuntimeError when it exits first, `deadline` passes or
        `stop` is set (Ctrl-C while starting)."""
        child = self._get(name)
        while not child.spec.ready(child.instance):
            if stop is not None and stop.is_set():
                raise RuntimeError(f"interrupted while {name} was starting")
            code = child.proc.poll()
            if code is not None:
                raise RuntimeError(f"{name} exited with {describe_exit(code)} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready in time (pid {child.pid})")
            time.sleep(poll_s)
        with self._lock:
            if child.state == "starting":
                child.state, child.answered_at = "running", time.monotonic()
                self._write_state()

    # --- watching -----------------------------------------------------------------------------
    def watch(self) -> None:
        """One pass: logs exits and schedules restarts, restarts what is due, and notes which
        restarted children serve again. Raises FatalChildError (see the module docstring)."""
        now = time.monotonic()
        with self._lock:
            children = list(self._children.values())
        for child in children:
            if child.state in ("starting", "running") and child.proc.poll() is not None:
                self._exited(child, now)
            elif child.state == "backoff" and now >= child.restart_at:
                self._restart(child)
            elif (child.state == "starting" and child.exited_at is not None
                  and child.spec.ready(child.instance)):
                with self._lock:
                    if child.state != "starting":
                        continue  # stopped on purpose meanwhile
                    child.state, child.answered_at = "running", time.monotonic()
                    self._write_state()
                self.log(f"{child.spec.name} serves again (pid {child.pid}, "
                         f"{time.monotonic() - child.exited_at:.1f} s after it went down)")
            elif (child.state == "running" and child.spec.alive is not None and self._liveness is not None
                  and now - child.answered_at > self.policy.unresponsive_s):
                self.log(f"{child.spec.name} (pid {child.pid}) has not answered its liveness check for "
                         f"{now - child.answered_at:.0f} s; killing it")
                child.answered_at = now  # once: its exit is seen on a later pass
                child.proc.kill()

    def _exited(self, child: Child, now: float) -> None:
        p = self.policy
        with self._lock:
            if child.state not in ("starting", "running"):
                return  # stopped on purpose meanwhile
            what = f"{child.spec.name} (pid {child.pid}) exited with {describe_exit(child.proc.returncode)}"
            if now - child.started >= p.stable_s:
                child.backoff = p.backoff_s
            while child.exits and now - child.exits[0] > p.window_s:
                child.exits.popleft()
            child.exits.append(now)
            child.exited_at = now
            if len(child.exits) > p.budget:
                child.state = "failed"
                self._write_state()
                message = (f"{what}; restart budget spent ({p.budget} restarts in "
                           f"{p.window_s:.0f} s): it stays down")
            else:
                child.state, child.restart_at = "backoff", now + child.backoff
                self._write_state()
                message = (f"{what}; restarting it in {child.backoff:.1f} s (restart "
                           f"{len(child.exits)} of {p.budget} allowed in {p.window_s:.0f} s)")
                child.backoff = min(child.backoff * 2, p.max_backoff_s)
        self.log(message)
        if child.state == "failed" and child.spec.critical:
            raise FatalChildError(f"{child.spec.name} keeps exiting; stopping everything")

    def _restart(self, child: Child) -> None:
        with self._lock:
            if child.state != "backoff":
                return
            try:
                child.proc, child.instance, child.started = self._spawn(child.spec)
            except OSError as e:  # no process at all (fork failed...): try again later
                child.restart_at = time.monotonic() + child.backoff
                child.backoff = min(child.backoff * 2, self.policy.max_backoff_s)
                self.log(f"{child.spec.name} could not be restarted ({e}); trying again")
                return
            child.state = "starting"
            child.restarts += 1
            self._write_state()
        self.log(f"{child.spec.name} restarted (pid {child.pid})")

    # --- stopping -----------------------------------------------------------------------------
    def forget(self, name: str) -> Child | None:
        """Stops supervising the child (it is not restarted when it exits); returns it."""
        with self._lock:
            child = self._children.get(name)
            if child is not None:
                child.state = "stopped"
                self._write_state()
            return child

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        """SIGTERM (the child drains), SIGKILL after `timeout_s`."""
        child = self.forget(name)
        if child is not None:
            _terminate([child.proc], timeout_s)

    def stop_all(self, groups: Sequence[Sequence[str]], timeout_s: float = 30.0) -> None:
        """Stops every child, group by group (kinds in each group), then whatever is left."""
        self._closing.set()
        with self._lock:
            for child in self._children.values():
                child.state = "stopped"
            children = list(self._children.values())
        for kinds in [*groups, None]:
            procs = [c.proc for c in children if kinds is None or c.spec.kind in kinds]
            _terminate(procs, timeout_s)
        self._write_state()

    # --- introspection ------------------------------------------------------------------------
    def children(self, kind: str | None = None) -> list[Child]:
        with self._lock:
            return [c for c in self._children.values() if kind is None or c.spec.kind == kind]

    def _get(self, name: str) -> Child:
        with self._lock:
            return self._children[name]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"pid": os.getpid(), "components": [
                {"name": c.spec.name, "kind": c.spec.kind, "target": c.spec.target, "pid": c.pid,
                 "instance_id": c.instance, "state": c.state, "restarts": c.restarts}
                for c in self._children.values()]}

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=1))
        os.replace(tmp, self.state_file)


def _terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOPped) child must see it too
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
