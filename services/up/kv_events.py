"""`pdserve up`'s KV cache events: every worker it starts publishes them (vLLM's format,
docs/kv-events.md) on its gRPC port + `--kv-events-port-offset` (replay on that + 1000), bound to
`--host` (loopback by default: the events carry prompt token ids). Workers the autoscaler starts
bind ports the system chooses; each worker's load report says where, and the router subscribes
to every worker that publishes."""

from __future__ import annotations

import argparse
import json

TOPIC = "kv-events"
REPLAY_OFFSET = 1000  # the replay socket's port, past the PUB socket's


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-events-port-offset", type=int, default=2000,
                   help="each worker publishes KV cache events (vLLM's ZMQ format, topic "
                        f"'{TOPIC}') on its gRPC port + this and answers replay requests on that "
                        f"+ {REPLAY_OFFSET}; the router routes on them (0 = off: the router's "
                        "approximate prefix index only)")


def config_json(host: str, port: int | None) -> str:
    """The worker's --kv-events-config: on `port` (None: one the system chooses)."""
    pub = "*" if port is None else str(port)
    replay = "*" if port is None else str(port + REPLAY_OFFSET)
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "bind": True,
                       "endpoint": f"tcp://{_host(host)}:{pub}",
                       "replay_endpoint": f"tcp://{_host(host)}:{replay}", "topic": TOPIC})


def worker_args(args: argparse.Namespace, grpc_port: int | None) -> list[str]:
    """A worker's flags: events on its gRPC port + the offset (None: ports the system chooses)."""
    if not args.kv_events_port_offset:
        return []
    port = None if grpc_port is None else grpc_port + args.kv_events_port_offset
    return ["--kv-events-config", config_json(args.host, port)]


def ports(args: argparse.Namespace, workers: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The event ports of the workers `up` starts (checked free with its others)."""
    offset = args.kv_events_port_offset
    if not offset:
        return []
    out = []
    for port, name in workers:
        out += [(port + offset, f"{name} kv events"), (port + offset + REPLAY_OFFSET, f"{name} kv replay")]
    bad = [p for p, _ in out if not 1 <= p <= 65535]
    if bad:
        raise ValueError(f"--kv-events-port-offset {offset} puts KV events on invalid ports {bad}; "
                         "choose another offset or 0 (off)")
    return out


def describe(args: argparse.Namespace, grpc_ports: list[int]) -> str | None:
    offset = args.kv_events_port_offset
    if not offset or not grpc_ports:
        return None
    pubs = ", ".join(str(p + offset) for p in grpc_ports)
    return (f"kv events: tcp://{_host(args.host)} ports {pubs} (topic '{TOPIC}'; replay on each "
            f"+ {REPLAY_OFFSET})")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
