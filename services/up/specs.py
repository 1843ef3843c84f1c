"""What `pdserve up` starts: each component's command line, ports, CPUs and readiness checks
(services/supervisor.py's ChildSpec)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.model.sources.default_model import is_default_model
from engine.spec.config import SpeculativeConfig
from services.procs import cli
from services.readiness import (
    router_alive,
    router_ready,
    store_alive,
    store_ready,
    worker_alive,
    worker_ready,
)
from services.secrets import DeploymentSecrets, component_env
from services.supervisor import ChildSpec
from services.up import kv_events as up_kv_events


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


def prefill_args(args: argparse.Namespace) -> list[str]:
    out = ["--tensor-parallel-size", str(args.prefill_tp)] if args.prefill_tp != 1 else []
    if args.prefill_max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    if args.prefill_scheduling_policy is not None:
        out += ["--scheduling-policy", args.prefill_scheduling_policy]
    return out


def decode_args(args: argparse.Namespace) -> list[str]:
    out = ["--tensor-parallel-size", str(args.decode_tp)] if args.decode_tp != 1 else []
    if args.speculative_config is not None:
        out += ["--speculative-config", args.speculative_config]
    return out


def _metrics_args(args: argparse.Namespace, grpc_port: int) -> list[str]:
    return ["--metrics-port", str(grpc_port + args.metrics_port_offset)] if args.metrics_port_offset else []


def worker_args(args: argparse.Namespace, folder: str, store: str) -> list[str]:
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


def named_ports(args: argparse.Namespace) -> dict[int, str]:
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


def child_specs(args: argparse.Namespace, folder: str, router_fd: int,
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
    common = worker_args(args, folder, store)
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
            specs.append(_worker_spec(args, f"prefill-{i}", "prefill", port, common + prefill_args(args),
                                      parse_cpus(args.prefill_cpus)))
    role = "colocated" if args.colocated else "decode"
    for i in range(args.decode):
        specs.append(_worker_spec(args, f"{role}-{i}", role, args.decode_port + i,
                                  common + decode_args(args), parse_cpus(args.decode_cpus)))
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
    router += tool_args(args, folder)
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


def tool_args(args: argparse.Namespace, folder: str) -> list[str]:
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
