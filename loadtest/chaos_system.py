"""The system a chaos run strikes: `pdserve up` as a child process (with a state file naming every
component's pid), faults sent to its components by signal, whether its pools are whole, and the
audit after the run.

Faults, `<action>:<component>`: action `kill` (SIGKILL), `freeze` (SIGSTOP, then SIGCONT after
the freeze time) or `restart` (SIGTERM: the component drains and exits, `pdserve up` restarts
it); component `prefill-0`, `decode-1`, `kvstore` (or `store`), `router`, or `core:<worker>` (that
worker's engine-core process). A kind (`prefill`, `decode`, `core:decode`) picks one of its
components in turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from services.procs import free_ports, stop_process

ROOT = Path(__file__).resolve().parent.parent
ACTIONS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "restart": signal.SIGTERM}
_WORKER = re.compile(r"(prefill|decode|colocated)(-[0-9]+)?")
_TARGET = re.compile(rf"{_WORKER.pattern}|kvstore|router")


@dataclass(frozen=True)
class Fault:
    action: str  # kill | freeze | restart
    target: str  # a component name, "core:<worker>", or a kind to pick from

    @classmethod
    def parse(cls, text: str) -> Fault:
        action, _, target = text.partition(":")
        target = "kvstore" if target == "store" else target
        core, _, worker = target.partition(":")
        if action not in ACTIONS or not (_TARGET.fullmatch(target) or
                                         (core == "core" and _WORKER.fullmatch(worker or "decode"))):
            raise ValueError(f"fault {text!r}: expected kill|freeze|restart:<component>, a component "
                             f"being prefill[-N], decode[-N], colocated[-N], kvstore, router or "
                             f"core[:<worker>]")
        if action == "restart" and core == "core":
            raise ValueError(f"fault {text!r}: an engine core is killed or frozen, not restarted")
        return cls(action, target)

    def __str__(self) -> str:
        return f"{self.action}:{self.target}"


class System:
    """`pdserve up --prefill P --decode D` on free loopback ports."""

    def __init__(self, model: str, prefill: int, decode: int, out: Path, extra: list[str]) -> None:
        self.port, store, p0, d0, live = free_ports(5)
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = out / "up-state.json"
        self.log = out / "up.log"
        self.expected = prefill + decode
        argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--prefill", str(prefill),
                "--decode", str(decode), "--port", str(self.port), "--kvstore-port", str(store),
                "--prefill-port", str(p0), "--decode-port", str(d0), "--metrics-port-offset", "0",
                "--router-liveness-port", str(live), "--state-file", str(self.state),
                "--secrets-dir", str(out / "secrets"), *extra]
        self.secrets = out / "secrets"  # the audit presents the workers' and the operator's tokens
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                     stderr=open(self.log, "w"))  # noqa: SIM115
        self.seen_pids: set[int] = set()
        self._turn: dict[str, int] = {}

    def wait_up(self, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "pdserve is up" in line:
                self.note_pids()
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"pdserve up did not come up (see {self.log})")

    # --- components ---------------------------------------------------------------------------
    def components(self) -> list[dict[str, Any]]:
        comps: list[dict[str, Any]] = json.loads(self.state.read_text())["components"]
        return comps

    def note_pids(self) -> None:
        """Remembers every component's pid and their children's (the orphan audit checks them)."""
        for comp in self.components():
            self.seen_pids.add(int(comp["pid"]))
            with contextlib.suppress(psutil.NoSuchProcess):
                children = psutil.Process(int(comp["pid"])).children(recursive=True)
                self.seen_pids.update(c.pid for c in children)

    def resolve(self, target: str) -> tuple[str, int]:
        """(what was struck, pid) for a fault target."""
        core = target.startswith("core")
        name = target.partition(":")[2] if core else target
        kinds = {"prefill", "decode", "colocated"}
        if name in ("", *kinds):  # a kind: its components in turn
            kind = name or "decode"
            names = sorted(c["name"] for c in self.components() if c["kind"] == kind)
            name = names[self._turn.get(target, 0) % len(names)]
            self._turn[target] = self._turn.get(target, 0) + 1
        pids = [int(c["pid"]) for c in self.components() if c["name"] == name]
        if not pids:
            raise ValueError(f"no component {name!r} in this system")
        pid = pids[0]
        if core:
            return f"core:{name}", engine_core_of(pid)
        return name, pid

    def strike(self, fault: Fault, freeze_s: float) -> str:
        """Sends the fault; a freeze lasts `freeze_s` (this call returns when it is over)."""
        self.note_pids()
        what, pid = self.resolve(fault.target)
        os.kill(pid, ACTIONS[fault.action])
        if fault.action == "freeze":
            time.sleep(freeze_s)
            os.kill(pid, signal.SIGCONT)
        return what

    def whole(self) -> bool:
        """Every component runs and every worker is healthy in the router's pools."""
        try:
            if any(c["state"] != "running" for c in self.components()):
                return False
            with urllib.request.urlopen(f"{self.url}/admin/workers", timeout=2) as resp:
                workers = json.loads(resp.read())["workers"]
            return len(workers) == self.expected and all(w["healthy"] for w in workers)
        except (OSError, ValueError, KeyError):
            return False

    def restarts(self) -> dict[str, int]:
        return {c["name"]: int(c["restarts"]) for c in self.components()}

    # --- the audit ----------------------------------------------------------------------------
    def audit_workers(self, timeout_s: float) -> dict[str, str]:
        """Per worker: "idle" once nothing runs or waits and every KV block is free, else why not."""
        import grpc

        from protos import worker_pb2 as pb
        from protos import worker_pb2_grpc as pb_grpc
        from services.worker.auth import WorkerAccess

        access = WorkerAccess(token=self._secret("worker-token"))  # what `up` gave its router
        verdicts: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        for comp in self.components():
            if comp["kind"] in ("kvstore", "router"):
                continue
            while True:
                try:
                    with access.channel(comp["target"]) as ch:
                        r = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=2,
                                                        metadata=access.metadata)
                    state = (f"running={r.num_running} waiting={r.num_waiting} "
                             f"blocks in use={r.num_total_blocks - r.num_free_blocks}")
                    if r.num_running == r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks:
                        verdicts[comp["name"]] = "idle, 0 blocks in use"
                        break
                except grpc.RpcError as e:
                    state = f"unreachable: {e.code().name}"
                if time.monotonic() > deadline:
                    verdicts[comp["name"]] = state
                    break
                time.sleep(0.5)
        return verdicts

    def audit_leases(self, timeout_s: float) -> int:
        """Leased store objects once they expired (waits up to `timeout_s` for 0)."""
        from kvstore.client import KVStoreClient

        store = next(c["target"] for c in self.components() if c["kind"] == "kvstore")
        client = KVStoreClient(f"grpc://{store}", timeout_s=5, use_shm=False,
                               token=self._secret("kv-admin-token"))  # stats: the admin role
        deadline = time.monotonic() + timeout_s
        try:
            while (leased := client.stats().leased) and time.monotonic() < deadline:
                time.sleep(1.0)
            return int(leased)
        finally:
            client.close()

    def _secret(self, name: str) -> str | None:
        path = self.secrets / name
        return path.read_text().strip() if path.exists() else None  # None: up ran with --no-auth

    def stop(self) -> int:
        self.note_pids()
        return stop_process(self.proc, timeout_s=120)

    def orphans(self) -> list[int]:
        """Processes of this run still alive after `pdserve up` stopped."""
        time.sleep(1.0)
        alive = []
        for pid in sorted(self.seen_pids):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def engine_core_of(worker_pid: int) -> int:
    for child in psutil.Process(worker_pid).children():
        if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
            return int(child.pid)
    raise RuntimeError(f"worker {worker_pid} has no engine-core process now")


def shm_leftovers() -> list[str]:
    from kvstore.shm import DEFAULT_ROOT, PREFIX

    root = Path(DEFAULT_ROOT)
    return sorted(str(p) for p in root.glob(f"{PREFIX}*")) if root.is_dir() else []
