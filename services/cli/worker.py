"""`pdserve worker`: a prefill, decode or colocated gRPC worker."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services import tracing
from services.cli.engine_args import add_engine_args, add_tracing_arg, engine_kwargs


def add_worker(subparsers: Any) -> None:
    p = subparsers.add_parser("worker", help="run a prefill, decode or colocated gRPC worker")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    add_tracing_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="default 50051 (prefill) or 50061 (decode, colocated); 0 = any free port")
    p.add_argument("--kv-store-url", default="grpc://127.0.0.1:50071",
                   help="the KV store, or several front-ends of one (a redis-cluster store): "
                        "grpc://a:50071,grpc://b:50071 or dns:name:50071 (every address)")
    p.add_argument("--kv-load-mode", default="auto", choices=["auto", "async", "layerwise"],
                   help="decode: load KV from the store inside the step that schedules the request "
                        "(layerwise), beside the running steps (async), or layer-wise up to "
                        "--kv-layerwise-max-tokens and async above (auto)")
    p.add_argument("--kv-layerwise-max-tokens", type=int, default=2048)
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="on SIGTERM, how long in-flight calls may finish")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use, the router's --model: the metrics' model_name "
                        "label (default: --model)")
    p.add_argument("--reuse-port", action="store_true",
                   help="let several worker processes share --port (SO_REUSEPORT); by default a "
                        "taken port is an error")
    a = p.add_argument_group("security (the token comes from $PDSERVE_WORKER_TOKEN or "
                             "$PDSERVE_WORKER_TOKEN_FILE, never argv)")
    a.add_argument("--tls-cert", default=None, metavar="PATH", help="serve TLS with this certificate (PEM)")
    a.add_argument("--tls-key", default=None, metavar="PATH", help="the --tls-cert's private key (PEM)")
    a.add_argument("--tls-client-ca", default=None, metavar="PATH",
                   help="mutual TLS: clients need a certificate this CA signed")
    a.add_argument("--no-auth", action="store_true",
                   help="allow a non-loopback --host with neither token nor client certificates "
                        "(a trusted network only)")
    g = p.add_argument_group("health (the engine core is watched; see docs/operations.md)")
    g.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="a Decode stream with nothing new gets an empty chunk this often")
    g.add_argument("--core-unready-s", type=float, default=3.0,
                   help="engine core silent this long: NOT_SERVING (no new requests) until it speaks")
    g.add_argument("--core-silence-s", type=float, default=10.0,
                   help="engine core silent this long: killed and restarted")
    g.add_argument("--step-timeout-s", type=float, default=300.0,
                   help="one engine step running this long: the core is killed and restarted")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="engine core restarts allowed in 10 minutes; past that the worker exits 1")
    add_engine_args(p)
    p.set_defaults(func=_run_worker)


def worker_engine_config(args: argparse.Namespace) -> Any:
    """The worker's EngineConfig: prefill workers default to shortest-first scheduling and, on
    the CPU, 512-token steps."""
    from engine.config import EngineConfig

    kwargs = engine_kwargs(args)
    if args.role == "prefill":
        kwargs.setdefault("scheduling_policy", "sjf")
        if args.device == "cpu":
            kwargs.setdefault("max_num_batched_tokens", 512)
    return EngineConfig(**kwargs, kv_store_url=args.kv_store_url,
                        kv_load_mode=args.kv_load_mode,
                        kv_layerwise_max_tokens=args.kv_layerwise_max_tokens)


def _run_worker(args: argparse.Namespace) -> int:
    import asyncio

    from kvstore.credentials import TLSFiles, read_secret
    from services.procs import PortInUseError
    from services.secrets import ENGINE_CORE_DROPS, drop_from_environ
    from services.worker.auth import TOKEN_ENV, ExposedWorkerError
    from services.worker.engine_guard import GuardOptions
    from services.worker.server import WorkerOptions, serve

    engine = worker_engine_config(args)
    port = args.port if args.port is not None else (50051 if args.role == "prefill" else 50061)
    guard = GuardOptions(unready_after_s=args.core_unready_s, silence_s=args.core_silence_s,
                         step_timeout_s=args.step_timeout_s, max_restarts=args.max_engine_restarts)
    options = WorkerOptions(role=args.role, engine=engine, host=args.host, port=port, grace_s=args.grace_s,
                            metrics_port=args.metrics_port, heartbeat_s=args.heartbeat_s,
                            reuse_port=args.reuse_port, guard=guard,
                            served_model_name=args.served_model_name, token=read_secret(TOKEN_ENV),
                            tls=TLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca),
                            no_auth=args.no_auth)
    drop_from_environ(ENGINE_CORE_DROPS)  # read: the engine cores it starts do not inherit them
    tracing.setup(f"pdserve-{args.role}", args.otlp_traces_endpoint)
    try:
        return asyncio.run(serve(options))
    except (PortInUseError, ExposedWorkerError) as e:
        print(f"pdserve worker: {e}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()
