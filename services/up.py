"""`pdserve up`: the whole system as local processes — the KV store (memory backend), prefill
workers, decode workers and the router — started in order, each waited for until it serves;
prints where to send requests. A component that exits while the system runs is restarted
(services/supervisor.py: backoff, a restart budget, each restart logged) and rejoins its pool;
only Ctrl-C (or SIGTERM) stops everything. `--colocated` runs workers that prefill and decode
themselves behind the same router, for comparison.

    pdserve up [--model M] [--prefill 1] [--decode 1] [--port 8000] [--colocated]

Every port is checked before anything starts: one that is taken is a one-line error naming the
port and the component, and the exit code is 1.

Credentials (docs/security.md): `up` generates the deployment's tokens at start into a private
directory (services/secrets.py; `--secrets-dir` keeps them somewhere chosen) and gives each
component its own by `*_FILE` environment variables, never argv; `--no-auth` runs everything
open (trusted networks only).
"""

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

from engine.config import DEFAULT_MODEL
from engine.model.sources.default_model import is_default_model
from engine.spec.config import SpeculativeConfig
from services import up_kv_events
from services.procs import PortInUseError, check_ports_free, cli, listen
from services.readiness import (
    router_alive,
    router_ready,
    store_alive,
    store_ready,
    worker_alive,
    worker_ready,
)
from services.secrets import DeploymentSecrets, component_env, ensure_secrets
from services.supervisor import ChildSpec, FatalChildError, RestartPolicy, Supervisor


class DefaultsHelp(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help says it (a None default must)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # a switch
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def add_up_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("up", help="start the KV store, workers and router locally",
                              formatter_class=DefaultsHelp)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a catalog model (default %(default)s; gemma-3-270m), a local .gguf file, a "
                        "local Hugging Face folder or a hub id (docs/models.md)")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers (with --autoscale: the fewest)")
    p.add_argument("--decode", type=int, default=1,
                   help="decode (or, with --colocated, colocated) workers (with --autoscale: the fewest)")
    p.add_argument("--colocated", action="store_true",
                   help="workers prefill and decode themselves (no KV transfer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address every component listens on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--kvstore-port", type=int, default=50071, help="the KV store's gRPC port")
    p.add_argument("--prefill-port", type=int, default=50051, help="first prefill worker's port")
    p.add_argument("--decode-port", type=int, default=50061, help="first decode worker's port")
    p.add_argument("--kvstore-capacity", default="4GiB", help="the KV store's memory")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per worker, per rank under tensor parallelism (default: "
                        "torch's, one per CPU the worker may use, shared out between its ranks)")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="each prefill worker's tensor-parallel size (processes, one rank each)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="each decode (or colocated) worker's tensor-parallel size; prefill and "
                        "decode may differ (the KV hand-off re-shards)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on the decode (and colocated) workers, vLLM's JSON, "
                        "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                        "(default: off)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="each worker's KV cache (default on the CPU: PDSERVE_CPU_KVCACHE_SPACE GiB "
                        "when set, else half the memory free at start divided among the workers "
                        "up starts, the autoscaler's maxima included)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest prompt + output (default: the model's context length)")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prefill workers' step budget (default: the worker's)")
    p.add_argument("--prefill-scheduling-policy", default=None, choices=["fcfs", "priority", "sjf"],
                   help="prefill workers' scheduling policy (default: the worker's, sjf)")
    p.add_argument("--startup-timeout-s", type=float, default=None,
                   help="how long the components may take to start (default: 600 s, plus 120 s for "
                        "each GiB of the model's weight files beyond the first)")
    p.add_argument("--unresponsive-s", type=float, default=60.0,
                   help="a running component that has not answered its liveness check this long is "
                        "killed and restarted (the clock starts when the watch begins, after start-up)")
    p.add_argument("--router-liveness-port", type=int, default=None,
                   help="the router answers liveness checks here, off its event loop (default: --port "
                        "+ 1000; 0: /livez on --port)")
    p.add_argument("--metrics-port-offset", type=int, default=1000,
                   help="each worker serves Prometheus /metrics on its gRPC port + this (0 = off); "
                        "the router's is at /metrics")
    up_kv_events.add_args(p)
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="every component sends request traces (OTLP) here; the standard "
                        "OTEL_EXPORTER_OTLP_* variables work too (default: off; docs/tracing.md)")
    p.add_argument("--prefill-cpus", default=None, metavar="LIST",
                   help="pin prefill workers (and their engine cores) to these CPUs, e.g. 0 or 0-1 "
                        "(default: unpinned)")
    p.add_argument("--decode-cpus", default=None, metavar="LIST",
                   help="pin decode (or colocated) workers to these CPUs (default: unpinned)")
    p.add_argument("--kvstore-cpus", default=None, metavar="LIST",
                   help="pin the KV store to these CPUs (default: unpinned)")
    p.add_argument("--router-cpus", default=None, metavar="LIST",
                   help="pin the router to these CPUs (default: unpinned)")
    p.add_argument("--policy", choices=["prefix_aware", "least_loaded"], default="prefix_aware",
                   help="how the router picks a worker of a pool: the one holding the longest cached "
                        "prefix of the prompt (spread by load), or the least loaded")
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="prompts with at most this many uncached tokens skip the prefill pool")
    p.add_argument("--handoff", choices=["early", "after-prefill"], default="early",
                   help="send each decode call with its prefill (early) or after it")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY, "
                        "comma-separated keys); visible in ps: prefer the variable or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="router: API keys, one per line, '#' comments (default: none)")
    p.add_argument("--tenant-cache-salt", action="store_true",
                   help="router: each API key is a tenant whose KV no other key's requests share")
    p.add_argument("--no-auth", action="store_true",
                   help="no credentials: the KV store and the workers take calls from anyone who "
                        "reaches their ports (trusted networks only)")
    p.add_argument("--secrets-dir", type=Path, default=None,
                   help="keep the generated credentials here (created 0700; existing ones reused) "
                        "(default: a private temporary directory, removed at exit)")
    p.add_argument("--stall-timeout-s", type=float, default=None,
                   help="router: a decode stream silent this long moves to another worker "
                        "(default: the router's, 5 s)")
    p.add_argument("--chat-template", default=None, metavar="PATH|NAME",
                   help="router: the chat template (default: hermes_tools, shipped with pdserve, for the "
                        "default model; the tokenizer's own for any other; '' = the tokenizer's own); "
                        "tool calls are parsed with the hermes parser, tool_choice \"auto\" enabled")
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "phi4_mini_json"],
                   help="router: how tool calls are found in replies (vLLM's names); default: the "
                        "model family's (llama3_json for Llama, mistral for Mistral/Mixtral, "
                        "phi4_mini_json for Phi-3/Phi-4-mini, else hermes)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="router: split chat replies' <think>...</think> into reasoning (vLLM's flag; "
                        "qwen3 for Qwen3 models, deepseek_r1 for DeepSeek-R1 and QwQ); default: off")
    p.add_argument("--restart-budget", type=int, default=5,
                   help="restarts of one component allowed within --restart-window-s")
    p.add_argument("--restart-window-s", type=float, default=300.0,
                   help="the window of --restart-budget, in seconds")
    p.add_argument("--state-file", type=Path, default=None,
                   help="keep a JSON file of the components (name, pid, port, state, restarts) "
                        "(default: none)")
    p.add_argument("--enable-responses-store", action="store_true",
                   help="router: keep /v1/responses sent with store=true in memory, for "
                        "previous_response_id and GET /v1/responses/{id} (vLLM keeps it off too)")
    from services.autoscaler.local import add_autoscale_args

    add_autoscale_args(p)
    p.set_defaults(func=run_up)


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
    out = ["--tensor-parallel-size", str(args.prefill_tp)] if args.prefill_tp != 1 else []
    if args.prefill_max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    if args.prefill_scheduling_policy is not None:
        out += ["--scheduling-policy", args.prefill_scheduling_policy]
    return out


def _decode_args(args: argparse.Namespace) -> list[str]:
    out = ["--tensor-parallel-size", str(args.decode_tp)] if args.decode_tp != 1 else []
    if args.speculative_config is not None:
        out += ["--speculative-config", args.speculative_config]
    return out


def _metrics_args(args: argparse.Namespace, grpc_port: int) -> list[str]:
    return ["--metrics-port", str(grpc_port + args.metrics_port_offset)] if args.metrics_port_offset else []


def _worker_args(args: argparse.Namespace, folder: str, store: str) -> list[str]:
    out = ["--kv-store-url", store, "--model", folder, "--served-model-name", args.model]
    for flag, value in (("--num-threads", args.num_threads), ("--kv-cache-gib", args.kv_cache_gib),
                        ("--max-model-len", args.max_model_len)):
        if value is not None:
            out += [flag, str(value)]
    if args.kv_cache_gib is None:  # the CPU default: the host's share, divided among its engines
        out += ["--kv-cache-sharers", str(kv_cache_sharers(args))]
    if getattr(args, "otlp_traces_endpoint", None):
        out += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return out


def kv_cache_sharers(args: argparse.Namespace) -> int:
    """How many engines `up` may run on this host at once (the autoscaler's maxima when it
    scales): each worker's default KV cache is its share of the memory free at start."""
    prefill = 0 if args.colocated else args.prefill
    decode = args.decode
    if getattr(args, "autoscale", False):
        prefill = 0 if args.colocated else max(prefill, args.max_prefill)
        decode = max(decode, args.max_decode)
    return max(1, prefill + decode)


def _up_networks(host: str) -> str:
    """The networks of the workers `up` (and its autoscaler) start: on `host` (loopback by default)."""
    import ipaddress

    nets = ["127.0.0.0/8", "::1/128"]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ",".join(nets)
    if not address.is_loopback:  # (0.0.0.0 too: the autoscaler registers its workers by it)
        nets.append(str(ipaddress.ip_network(address)))
    return ",".join(nets)


def _liveness_port(args: argparse.Namespace) -> int:
    """The router's liveness port (0: none, /livez on the API port)."""
    return args.port + 1000 if args.router_liveness_port is None else args.router_liveness_port


def startup_timeout_s(args: argparse.Namespace, folder: str) -> float:
    """--startup-timeout-s, else 600 s plus 120 s for each GiB of weights beyond the first (what
    loading takes grows with the model)."""
    if args.startup_timeout_s is not None:
        return float(args.startup_timeout_s)
    weights = sum(f.stat().st_size for f in Path(folder).glob("*")
                  if f.suffix in (".safetensors", ".bin", ".gguf", ".pt") and f.is_file())
    return 600.0 + 120.0 * max(0.0, weights / 2**30 - 1.0)


def _ports(args: argparse.Namespace) -> dict[int, str]:
    """Every port `up` will listen on, with its component (and the TP sizes checked, before
    anything starts)."""
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if not 1 <= tp <= 64:
            raise ValueError(f"{flag}: must be in [1, 64], got {tp}")
    if args.speculative_config is not None:  # a bad one is refused before anything starts
        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
    role = "colocated" if args.colocated else "decode"
    named = [(args.port, "router")]
    if _liveness_port(args):
        named.append((_liveness_port(args), "router liveness"))
    if not args.colocated:
        named.append((args.kvstore_port, "kvstore"))
        named += [(args.prefill_port + i, f"prefill-{i}") for i in range(args.prefill)]
    named += [(args.decode_port + i, f"{role}-{i}") for i in range(args.decode)]
    if args.metrics_port_offset:
        workers = [(p + args.metrics_port_offset, f"{n} metrics") for p, n in named
                   if n not in ("router", "router liveness", "kvstore")]
        bad = [p for p, _ in workers if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"--metrics-port-offset {args.metrics_port_offset} puts worker metrics on "
                             f"invalid ports {bad}; choose another offset or 0 (off)")
        named += workers
    named += up_kv_events.ports(args, [(p, n) for p, n in named
                                       if n not in ("router", "router liveness", "kvstore")
                                       and not n.endswith("metrics")])
    ports: dict[int, str] = {}
    for port, name in named:
        if port in ports:
            raise ValueError(f"{name} and {ports[port]} would share port {port}: choose other ports")
        ports[port] = name
    return ports


def _no_auth(args: argparse.Namespace) -> list[str]:
    return ["--no-auth"] if args.no_auth else []


def _specs(args: argparse.Namespace, folder: str, router_fd: int,
           creds: DeploymentSecrets | None) -> tuple[list[ChildSpec], ChildSpec]:
    """The store and workers (in start order), and the router (on the listening socket
    `router_fd`, which `up` holds: clients connecting while the router restarts wait). Workers
    inherit the launcher's environment, which holds their credentials (`_use_credentials`);
    the store and the router get their own."""
    h = args.host
    store_env = None
    if creds:  # the store gets its own, none of the workers' (the checksum key above all)
        store_env = {**component_env("kvstore", os.environ), **creds.store_env()}
    store = f"grpc://{h}:{args.kvstore_port}"
    common = _worker_args(args, folder, store)
    specs = []
    if not args.colocated:
        specs.append(ChildSpec("kvstore", "kvstore", cli("kvstore", "--host", h, "--port",
                                                         str(args.kvstore_port), "--capacity",
                                                         args.kvstore_capacity, "--log-level", "WARNING",
                                                         *_no_auth(args)),
                               store_ready(store), target=f"{h}:{args.kvstore_port}", env=store_env,
                               cpus=_frozen(parse_cpus(args.kvstore_cpus)), alive=store_alive(store)))
        for i in range(args.prefill):
            port = args.prefill_port + i
            specs.append(_worker_spec(args, f"prefill-{i}", "prefill", port, common + _prefill_args(args),
                                      parse_cpus(args.prefill_cpus)))
    role = "colocated" if args.colocated else "decode"
    for i in range(args.decode):
        specs.append(_worker_spec(args, f"{role}-{i}", role, args.decode_port + i,
                                  common + _decode_args(args), parse_cpus(args.decode_cpus)))
    router = ["router", "--model", args.model, "--tokenizer", folder, "--host", h,
              "--port", str(args.port), "--policy", args.policy, "--worker-networks", _up_networks(h),
              "--local-prefill-tokens", str(args.local_prefill_tokens), "--handoff", args.handoff,
              "--fd", str(router_fd)]
    for spec in specs:
        if spec.kind != "kvstore":
            router += [f"--{'decode' if spec.kind == 'colocated' else spec.kind}", spec.target]
    if args.max_model_len is not None:
        router += ["--max-model-len", str(args.max_model_len)]
    if args.stall_timeout_s is not None:
        router += ["--stall-timeout-s", str(args.stall_timeout_s)]
    if args.api_key_file:
        router += ["--api-key-file", args.api_key_file]
    if args.tenant_cache_salt:
        router += ["--tenant-cache-salt"]
    if args.enable_responses_store:
        router += ["--enable-responses-store"]
    if args.otlp_traces_endpoint:
        router += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    router += _tool_args(args, folder)
    # Keys go by environment, not argv (ps shows argv); the router holds no store credential.
    if args.api_key and args.api_key != os.environ.get("PDSERVE_API_KEY"):
        print("pdserve up: warning: --api-key on the command line is visible to other users of this "
              "host (ps); use $PDSERVE_API_KEY or --api-key-file", file=sys.stderr)
    env = component_env("router", os.environ)
    if args.api_key:
        env["PDSERVE_API_KEY"] = args.api_key
    url = f"http://{h}:{args.port}"
    live = f"http://{h}:{_liveness_port(args)}" if _liveness_port(args) else url
    if _liveness_port(args):
        router += ["--liveness-port", str(_liveness_port(args))]
    router_spec = ChildSpec("router", "router", cli(*router), router_ready(url), target=f"{h}:{args.port}",
                            env=env, cpus=_frozen(parse_cpus(args.router_cpus)), critical=True,
                            alive=router_alive(live), pass_fds=(router_fd,))
    return specs, router_spec


def _tool_args(args: argparse.Namespace, folder: str) -> list[str]:
    """Tools work out of the box: the default model's own template has none, so it gets pdserve's
    (which renders plain chats exactly as the model's does); calls are found by the parser of the
    model's family (--tool-call-parser, else `default_tool_parser`). --reasoning-parser goes
    through as given (off by default, as vLLM's)."""
    template = args.chat_template
    if template is None and is_default_model(args.model):
        template = "hermes_tools"
    out = ["--chat-template", template] if template else []
    reasoning = getattr(args, "reasoning_parser", None)
    out += ["--reasoning-parser", reasoning] if reasoning else []
    parser = getattr(args, "tool_call_parser", None) or default_tool_parser(args.model, folder)
    return [*out, "--tool-call-parser", parser, "--enable-auto-tool-choice"]


def default_tool_parser(model: str, folder: str) -> str:
    """The tool-call format of the model's family, as vLLM's docs pair them: Llama 3.x writes
    bare JSON (llama3_json), Mistral and Mixtral `[TOOL_CALLS]...` (mistral), Phi-4-mini
    (`Phi3ForCausalLM`) `functools[...]` (phi4_mini_json), Qwen and the default model (pdserve's
    template) Hermes tags."""
    import json

    if is_default_model(model):
        return "hermes"
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return "hermes"
    arch = " ".join(config.get("architectures") or [])
    if "Mistral" in arch or "Mixtral" in arch:
        return "mistral"
    if "Phi3ForCausalLM" in arch:
        return "phi4_mini_json"
    return "llama3_json" if "Llama" in arch else "hermes"


def _worker_spec(args: argparse.Namespace, name: str, role: str, port: int, extra: list[str],
                 cpus: set[int] | None) -> ChildSpec:
    target = f"{args.host}:{port}"
    argv = cli("worker", "--role", role, "--host", args.host, "--port", str(port),
               *_metrics_args(args, port), *up_kv_events.worker_args(args, port), *_no_auth(args), *extra)
    return ChildSpec(name, role, argv, worker_ready(target), target=target, cpus=_frozen(cpus),
                     alive=worker_alive(target), env=component_env(role, os.environ))


def _frozen(cpus: set[int] | None) -> frozenset[int] | None:
    return frozenset(cpus) if cpus else None


def run_up(args: argparse.Namespace) -> int:
    from engine.model.loader import resolve_model_path

    for text in (args.prefill_cpus, args.decode_cpus, args.kvstore_cpus, args.router_cpus):
        parse_cpus(text)  # bad lists fail before anything starts
    try:
        check_ports_free(args.host, _ports(args))
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
    specs, router = _specs(args, folder, router_socket.fileno(), creds)
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
    worker_args = [*_worker_args(args, folder, f"grpc://{args.host}:{args.kvstore_port}"),
                   *up_kv_events.worker_args(args, None)]  # (ports the system chooses)
    cpus = {"prefill": parse_cpus(args.prefill_cpus), role: parse_cpus(args.decode_cpus)}
    scaler = AutoscalerThread(args, f"http://{args.host}:{args.port}", worker_args, cpus, role,
                              role_args={"prefill": _prefill_args(args), role: _decode_args(args)},
                              supervisor=sup)
    scaler.start()
    print(f"autoscaling: prefill {args.prefill}..{max(args.prefill, args.max_prefill)}, "
          f"{role} {args.decode}..{max(args.decode, args.max_decode)}, targets TTFT p90 "
          f"{args.ttft_ms:.0f} ms, ITL p90 {args.itl_ms:.0f} ms", flush=True)
    return scaler
