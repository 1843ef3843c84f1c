"""`pdserve up`: the whole system as local processes — the KV store (memory backend), prefill
workers, decode workers and the router — started in order, each waited for until healthy;
prints where to send requests; Ctrl-C (or SIGTERM) stops everything. `--colocated` runs
workers that prefill and decode themselves behind the same router, for comparison.

    pdserve up [--model M] [--prefill 1] [--decode 1] [--port 8000] [--colocated]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from engine.config import DEFAULT_MODEL


def add_up_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("up", help="start the KV store, workers and router locally")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode (or colocated) workers")
    p.add_argument("--colocated", action="store_true",
                   help="workers prefill and decode themselves (no KV transfer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--kvstore-port", type=int, default=50071)
    p.add_argument("--prefill-port", type=int, default=50051, help="first prefill worker's port")
    p.add_argument("--decode-port", type=int, default=50061, help="first decode worker's port")
    p.add_argument("--kvstore-capacity", default="4GiB")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prefill workers' step budget (default: the worker's)")
    p.add_argument("--prefill-scheduling-policy", default=None, choices=["fcfs", "priority", "sjf"],
                   help="prefill workers' scheduling policy (default: the worker's, sjf)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--metrics-port-offset", type=int, default=1000,
                   help="each worker serves Prometheus /metrics on its gRPC port + this (0 = off); "
                        "the router's is at /metrics")
    p.add_argument("--prefill-cpus", default=None, metavar="LIST",
                   help="pin prefill workers (and their engine cores) to these CPUs, e.g. 0 or 0-1")
    p.add_argument("--decode-cpus", default=None, metavar="LIST",
                   help="pin decode (or colocated) workers to these CPUs")
    p.add_argument("--kvstore-cpus", default=None, metavar="LIST",
                   help="pin the KV store to these CPUs (default: unpinned)")
    p.add_argument("--router-cpus", default=None, metavar="LIST",
                   help="pin the router to these CPUs (default: unpinned)")
    p.add_argument("--policy", choices=["prefix_aware", "least_loaded"], default="prefix_aware")
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="prompts with at most this many uncached tokens skip the prefill pool")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY)")
    from services.autoscaler.local import add_autoscale_args

    add_autoscale_args(p)
    p.set_defaults(func=run_up)


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cpus: set[int] | None = None) -> None:
        def setup() -> None:
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)  # children (the engine core) inherit it

        proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], preexec_fn=setup, env=env)
        self.procs.append((name, proc))

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def wait(self, name: str, ready: Any, deadline: float) -> None:
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {self.args.startup_timeout_s} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stops the router first (no new requests), then the workers (they drain), then the
        store; each bounded in time."""
        groups = [[p for n, p in self.procs if n == "router"],
                  [p for n, p in self.procs if n not in ("router", "kvstore")],
                  [p for n, p in self.procs if n == "kvstore"]]
        for group in groups:
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


def parse_cpus(text: str | None) -> set[int] | None:
    """"0", "0-1", "0,2-3" -> a CPU set; None or "" -> None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"CPU list {text!r}: expected numbers and ranges like 0,2-3") from None
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise ValueError(f"CPU list {text!r}: CPUs {sorted(cpus - available)} are not available "
                         f"(this process may use {sorted(available)})")
    return cpus


def _prefill_args(args: argparse.Namespace) -> list[str]:
    out = []
    if args.prefill_max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    if args.prefill_scheduling_policy is not None:
        out += ["--scheduling-policy", args.prefill_scheduling_policy]
    return out


def _metrics_args(args: argparse.Namespace, grpc_port: int) -> list[str]:
    return ["--metrics-port", str(grpc_port + args.metrics_port_offset)] if args.metrics_port_offset else []


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM when the launcher dies, even by SIGKILL (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _grpc_serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def run_up(args: argparse.Namespace) -> int:
    from engine.model.loader import resolve_model_path

    for text in (args.prefill_cpus, args.decode_cpus, args.kvstore_cpus, args.router_cpus):
        parse_cpus(text)  # bad lists fail before anything starts
    if args.metrics_port_offset:
        ports = [args.prefill_port + i for i in range(0 if args.colocated else args.prefill)]
        ports += [args.decode_port + i for i in range(args.decode)]
        bad = [p + args.metrics_port_offset for p in ports if not 1 <= p + args.metrics_port_offset <= 65535]
        if bad:
            raise ValueError(f"--metrics-port-offset {args.metrics_port_offset} puts worker metrics on "
                             f"invalid ports {bad}; choose another offset or 0 (off)")
    # Resolve (and, the first time, convert) the model once, not once per worker.
    folder = str(resolve_model_path(args.model))
    launcher = Launcher(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    h = args.host
    engine_args = ["--model", folder]
    for flag, value in (("--num-threads", args.num_threads), ("--kv-cache-gib", args.kv_cache_gib),
                        ("--max-model-len", args.max_model_len)):
        if value is not None:
            engine_args += [flag, str(value)]
    store = f"grpc://{h}:{args.kvstore_port}"
    scaler: Any = None
    deadline = time.monotonic() + args.startup_timeout_s
    try:
        prefill, decode = [], []
        if not args.colocated:
            launcher.start("kvstore", ["kvstore", "--host", h, "--port", str(args.kvstore_port),
                                       "--capacity", args.kvstore_capacity, "--log-level", "WARNING"],
                           cpus=parse_cpus(args.kvstore_cpus))
            launcher.wait("kvstore", lambda: _port_open(h, args.kvstore_port), deadline)
            for i in range(args.prefill):
                target = f"{h}:{args.prefill_port + i}"
                launcher.start(f"prefill-{i}", ["worker", "--role", "prefill", "--host", h, "--port",
                                                str(args.prefill_port + i), "--kv-store-url", store,
                                                *_metrics_args(args, args.prefill_port + i),
                                                *engine_args, *_prefill_args(args)],
                               cpus=parse_cpus(args.prefill_cpus))
                prefill.append(target)
        role = "colocated" if args.colocated else "decode"
        for i in range(args.decode):
            target = f"{h}:{args.decode_port + i}"
            launcher.start(f"{role}-{i}", ["worker", "--role", role, "--host", h, "--port",
                                           str(args.decode_port + i), "--kv-store-url", store,
                                           *_metrics_args(args, args.decode_port + i), *engine_args],
                           cpus=parse_cpus(args.decode_cpus))
            decode.append(target)
        for target in prefill + decode:
            launcher.wait(f"worker {target}", lambda t=target: _grpc_serving(t), deadline)
        router = ["router", "--model", args.model, "--tokenizer", folder, "--host", h,
                  "--port", str(args.port), "--policy", args.policy,
                  "--local-prefill-tokens", str(args.local_prefill_tokens)]
        for target in prefill:
            router += ["--prefill", target]
        for target in decode:
            router += ["--decode", target]
        if args.max_model_len is not None:
            router += ["--max-model-len", str(args.max_model_len)]
        env = {**os.environ, "PDSERVE_API_KEY": args.api_key} if args.api_key else None
        # The API key goes by environment, not argv (ps shows argv).
        launcher.start("router", router, env, cpus=parse_cpus(args.router_cpus))
        launcher.wait("router", lambda: _http_ok(f"http://{h}:{args.port}/health"), deadline)
        mode = "colocated" if args.colocated else f"{len(prefill)} prefill + {len(decode)} decode"
        print(f"pdserve is up ({mode}, model {args.model}): OpenAI API at http://{h}:{args.port}/v1 "
              f"- Ctrl-C stops everything", flush=True)
        if args.metrics_port_offset:
            ports = [int(t.rsplit(":", 1)[1]) + args.metrics_port_offset for t in prefill + decode]
            print(f"metrics: http://{h}:{args.port}/metrics (router); worker /metrics on ports "
                  f"{', '.join(map(str, ports))}", flush=True)
        if args.autoscale:
            from services.autoscaler.local import AutoscalerThread

            worker_args = ["--kv-store-url", store, *engine_args]
            cpus = {"prefill": parse_cpus(args.prefill_cpus), role: parse_cpus(args.decode_cpus)}
            scaler = AutoscalerThread(args, f"http://{h}:{args.port}", worker_args, cpus, role,
                                      role_args={"prefill": _prefill_args(args)})
            scaler.start()
            print(f"autoscaling: prefill {args.prefill}..{max(args.prefill, args.max_prefill)}, "
                  f"{role} {args.decode}..{max(args.decode, args.max_decode)}, targets TTFT p90 "
                  f"{args.ttft_ms:.0f} ms, ITL p90 {args.itl_ms:.0f} ms", flush=True)
        while not stop.wait(0.5):
            launcher.check_alive()
        return 0
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        if scaler is not None:
            scaler.stop()  # drains and stops the workers it started
        launcher.stop()
