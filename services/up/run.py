"""`pdserve up` itself: checks the ports, starts the components in order under the supervisor,
prints where to send requests, and stops everything on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from services.procs import PortInUseError, check_ports_free, listen
from services.secrets import DeploymentSecrets, ensure_secrets
from services.supervisor import ChildSpec, FatalChildError, RestartPolicy, Supervisor
from services.up import kv_events as up_kv_events
from services.up.specs import (
    child_specs,
    decode_args,
    named_ports,
    parse_cpus,
    prefill_args,
    startup_timeout_s,
    worker_args,
)


def run_up(args: argparse.Namespace) -> int:
    from engine.model.loader import resolve_model_path

    for text in (args.prefill_cpus, args.decode_cpus, args.kvstore_cpus, args.router_cpus):
        parse_cpus(text)  # bad lists fail before anything starts
    try:
        check_ports_free(args.host, named_ports(args))
        router_socket = listen(args.host, args.port, "router")  # held for every router incarnation
    except PortInUseError as e:
        print(f"pdserve up: {e}; nothing was started", file=sys.stderr)
        return 1
    # Resolve (and, the first time, convert) the model once, not once per worker.
    folder = str(resolve_model_path(args.model))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sup = Supervisor(RestartPolicy(budget=args.restart_budget, window_s=args.restart_window_s,
                                   unresponsive_s=args.unresponsive_s), state_file=args.state_file)
    private = None
    if not args.no_auth and args.secrets_dir is None:
        private = tempfile.TemporaryDirectory(prefix="pdserve-secrets-")
    creds = None if args.no_auth else _use_credentials(Path(private.name) if private else args.secrets_dir)
    specs, router = child_specs(args, folder, router_socket.fileno(), creds)
    scaler: Any = None
    deadline = time.monotonic() + startup_timeout_s(args, folder)
    try:
        for spec in specs:
            sup.start(spec)
            if spec.kind == "kvstore":
                sup.wait_ready(spec.name, deadline, stop=stop)  # workers connect to it as they start
        for spec in specs:
            sup.wait_ready(spec.name, deadline, stop=stop)
        sup.start(router)
        sup.wait_ready(router.name, deadline, stop=stop)
        _print_up(args, specs)
        sup.start_liveness()
        if args.autoscale:
            scaler = _start_autoscaler(args, folder, sup)
        while not stop.wait(0.5):
            sup.watch()
        return 0
    except (RuntimeError, FatalChildError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        if scaler is not None:
            scaler.stop()  # drains and stops the workers it started
        # The router first (no new requests), then the workers (they drain), then the store.
        names = [c.spec.name for c in sup.children()]
        sup.stop_all([["router"], ["prefill", "decode", "colocated"], ["kvstore"]])
        router_socket.close()
        if private is not None:
            private.cleanup()
        print(f"pdserve up: stopped ({', '.join(names) or 'nothing was running'})", flush=True)


def _use_credentials(directory: Path) -> DeploymentSecrets:
    """Generates (or reuses) the credentials and puts the workers' into this process's
    environment: the workers it starts, now or later (the autoscaler), inherit them, and its
    readiness checks present them."""
    creds = ensure_secrets(directory)
    for name in creds.worker_env():  # a value left in the operator's shell would win over a file
        os.environ.pop(name.removesuffix("_FILE"), None)
    os.environ.update(creds.worker_env())
    return creds


def _print_up(args: argparse.Namespace, specs: list[ChildSpec]) -> None:
    h = args.host
    workers = [s for s in specs if s.kind != "kvstore"]
    count = {kind: sum(s.kind == kind for s in workers) for kind in ("prefill", "decode")}
    mode = "colocated" if args.colocated else f"{count['prefill']} prefill + {count['decode']} decode"
    print(f"pdserve is up ({mode}, model {args.model}): OpenAI API at http://{h}:{args.port}/v1 "
          f"- Ctrl-C stops everything", flush=True)
    if args.metrics_port_offset:
        ports = [int(s.target.rsplit(":", 1)[1]) + args.metrics_port_offset for s in workers]
        print(f"metrics: http://{h}:{args.port}/metrics (router); worker /metrics on ports "
              f"{', '.join(map(str, ports))}", flush=True)
    events = up_kv_events.describe(args, [int(s.target.rsplit(":", 1)[1]) for s in workers])
    if events:
        print(events, flush=True)


def _start_autoscaler(args: argparse.Namespace, folder: str, sup: Supervisor) -> Any:
    from services.autoscaler.local import AutoscalerThread

    role = "colocated" if args.colocated else "decode"
    argv = [*worker_args(args, folder, f"grpc://{args.host}:{args.kvstore_port}"),
                   *up_kv_events.worker_args(args, None)]  # (ports the system chooses)
    cpus = {"prefill": parse_cpus(args.prefill_cpus), role: parse_cpus(args.decode_cpus)}
    scaler = AutoscalerThread(args, f"http://{args.host}:{args.port}", argv, cpus, role,
                              role_args={"prefill": prefill_args(args), role: decode_args(args)},
                              supervisor=sup)
    scaler.start()
    print(f"autoscaling: prefill {args.prefill}..{max(args.prefill, args.max_prefill)}, "
          f"{role} {args.decode}..{max(args.decode, args.max_decode)}, targets TTFT p90 "
          f"{args.ttft_ms:.0f} ms, ITL p90 {args.itl_ms:.0f} ms", flush=True)
    return scaler
