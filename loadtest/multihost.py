"""The disaggregated system as a fleet would run it, on one machine: the KV store (memory
backend), prefill workers, decode workers and the router, each a real `pdserve` process, either
each on a host of its own (loadtest/netns.py: own network namespace, address and /dev/shm) or
all on loopback, for the multi-host test and benchmark.

Credentials as a deployment has them (services/secrets.py): the store serves its address with a
token file, workers present their store token and the router its worker token, each component
getting only its own files by `*_FILE` variables.

    with Fleet(FleetSpec(model=folder), Hosts(6)) as fleet:   # or Fleet(spec, None): loopback
        openai.OpenAI(base_url=fleet.base_url, api_key="x")
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.netns import Host, Hosts
from services.procs import cli, port_free, spawn, stop_process
from services.readiness import router_ready, store_ready, worker_ready
from services.secrets import DeploymentSecrets, ensure_secrets

ROOT = Path(__file__).resolve().parents[1]
# The ports of a host of its own (compose's, moved into 22000..22999, which these tests own);
# loopback takes free ones of BASE_PORT..+899.
PORTS = {"kvstore": 22071, "prefill": 22051, "decode": 22061, "router": 22080}
BASE_PORT = 22100


@dataclass(frozen=True)
class FleetSpec:
    """What runs: `prefill` + `decode` workers of `model` (a local folder) with `engine_args`,
    behind a router serving it as `served_name`."""

    model: str
    served_name: str = "tiny"
    prefill: int = 2
    decode: int = 2
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ("--policy", "least_loaded")
    store_capacity: str = "512MiB"
    startup_timeout_s: float = 180.0

    @property
    def num_hosts(self) -> int:
        """One host per component: the store, each worker, the router."""
        return 2 + self.prefill + self.decode


@dataclass
class Component:
    name: str
    address: str  # where it listens (host:port)
    proc: subprocess.Popen[bytes] | None = None
    instance: str = field(default_factory=lambda: os.urandom(8).hex())


class Fleet:
    """Starts the components (the store first, then the workers and the router together) on
    `hosts` (one each, in that order) or on loopback (`hosts` None); stops them in reverse on
    `stop()`, also when a start failed. Logs go to `log_dir` (default: a temporary one)."""

    def __init__(self, spec: FleetSpec, hosts: Hosts | None, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.hosts = hosts
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-fleet-")
        self.log_dir = log_dir or Path(self._tmp.name) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.secrets: DeploymentSecrets = ensure_secrets(Path(self._tmp.name) / "secrets")
        # The admin API (/admin/workers) answers other hosts only with a key.
        self.admin_key = secrets.token_urlsafe(24)
        self._admin_key_file = Path(self.secrets.path("admin-api-key"))
        self._admin_key_file.write_text(self.admin_key + "\n")
        self._admin_key_file.chmod(0o600)
        self.ready_s: dict[str, float] = {}  # seconds from start() until each component served
        self.components: list[Component] = []
        self._ports: set[int] = set()
        self._t0 = 0.0

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- where things are ----------------------------------------------------------------------
    def _host(self, i: int) -> Host | None:
        return None if self.hosts is None else self.hosts[i]

    def _address(self, i: int, kind: str) -> str:
        host = self._host(i)
        if host is not None:
            return f"{host.address}:{PORTS[kind]}"
        return f"127.0.0.1:{self._loopback_port()}"

    def _loopback_port(self) -> int:
        for port in range(BASE_PORT, BASE_PORT + 900):
            if port not in self._ports and port_free("127.0.0.1", port):
                self._ports.add(port)
                return port
        raise RuntimeError(f"no free loopback port in {BASE_PORT}..{BASE_PORT + 899}")

    def by_kind(self, kind: str) -> list[Component]:
        return [c for c in self.components if c.name.startswith(kind)]

    @property
    def store_url(self) -> str:
        return f"grpc://{self.by_kind('kvstore')[0].address}"

    @property
    def router_url(self) -> str:
        return f"http://{self.by_kind('router')[0].address}"

    @property
    def base_url(self) -> str:
        return f"{self.router_url}/v1"

    def host_of(self, name: str) -> Host | None:
        """The host a component runs on (None on loopback)."""
        return self._host([c.name for c in self.components].index(name))

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        s, creds = self.spec, self.secrets
        self._t0 = time.monotonic()
        deadline = self._t0 + s.startup_timeout_s
        store = self._launch("kvstore", "kvstore", ["--capacity", s.store_capacity,
                                                    "--log-level", "WARNING"], creds.store_env())
        with _environment(creds.admin_env()):  # the health action needs a valid token
            self._wait(store, store_ready(self.store_url), deadline)
        common = ["--kv-store-url", self.store_url, "--model", s.model, "--served-model-name",
                  s.served_name, *s.engine_args]
        workers = [self._launch(f"prefill-{i}", "prefill", ["--role", "prefill", *common],
                                creds.worker_env()) for i in range(s.prefill)]
        workers += [self._launch(f"decode-{i}", "decode", ["--role", "decode", *common],
                                 creds.worker_env()) for i in range(s.decode)]
        # The router starts beside the workers (their addresses are known): its pools take each
        # worker once its load report says it serves.
        targets = [a for w in workers for a in (f"--{w.name.split('-')[0]}", w.address)]
        router = self._launch("router", "router", ["--model", s.served_name, "--tokenizer", s.model,
                                                   *targets, *s.router_args],
                              {**creds.router_env(), "PDSERVE_ADMIN_API_KEY_FILE": str(self._admin_key_file)})
        with _environment(creds.router_env()):  # the readiness check presents the router's token
            for w in workers:
                self._wait(w, worker_ready(w.address), deadline)
        self._wait(router, router_ready(self.router_url), deadline)

    def _launch(self, name: str, kind: str, args: list[str], secrets_env: dict[str, str]) -> Component:
        i = len(self.components)
        comp = Component(name, self._address(i, kind))
        self.components.append(comp)
        host, port = comp.address.rsplit(":", 1)
        argv = cli(kind if kind in ("kvstore", "router") else "worker", "--host", host, "--port", port,
                   *args)
        placed = self._host(i)
        if placed is not None:
            argv = placed.argv(argv)
        # Only this component's credentials: no PDSERVE_* of the caller leaks in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env.update(secrets_env, PYTHONPATH=str(ROOT))
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        comp.proc = spawn(argv, env=env, instance=comp.instance, cwd=ROOT, stdout=log, stderr=log)
        log.close()
        return comp

    def _wait(self, comp: Component, ready: Callable[[str], bool], deadline: float) -> None:
        while not ready(comp.instance):
            code = comp.proc.poll() if comp.proc is not None else None
            if code is not None:
                raise RuntimeError(f"{comp.name} exited with {code}: {self.log_tail(comp.name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{comp.name} at {comp.address} not ready in time: "
                                   f"{self.log_tail(comp.name)}")
            time.sleep(0.1)
        self.ready_s[comp.name] = time.monotonic() - self._t0

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def stop(self) -> None:
        """The router first (no new requests), then the workers (together), then the store."""
        for tier in ("router", "prefill", "kvstore"):
            procs = [c.proc for c in self.components if c.proc is not None and
                     {"router": "router", "kvstore": "kvstore"}.get(c.name.split("-")[0], "prefill") == tier]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                stop_process(proc, signal.SIGTERM, timeout_s=20)
        self.components = []
        self._tmp.cleanup()


class _environment:
    """Sets environment variables of this process for a `with` block, then restores them."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
