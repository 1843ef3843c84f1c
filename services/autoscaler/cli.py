"""`pdserve autoscaler`: the autoscaler as its own process, beside a running router, with the
Docker actuator (a compose project's services; what compose.yaml's `autoscale` profile runs) or
the Kubernetes actuator (the prefill / decode Deployments' scale subresource; docs/kubernetes-autoscaler.md).
(`pdserve up --autoscale` runs the same loop inside the local launcher instead.)

    pdserve autoscaler --router http://router:8000 --project pdserve --prefill 1 \\
        --max-prefill 3 --decode 1 --max-decode 3 --ttft-ms 2000 --itl-ms 200
    pdserve autoscaler --actuator kubernetes --router http://pdserve-router:8000 --max-prefill 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

from services.autoscaler.k8s_cli import add_kubernetes_args, kubernetes_actuator
from services.autoscaler.local import add_autoscale_args, planner_config
from services.router.http.api_keys import first_api_key


def add_autoscaler_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("autoscaler", help="size the prefill / decode pools of a compose project "
                                                 "or a Kubernetes namespace")
    p.add_argument("--router", default=os.environ.get("PDSERVE_ROUTER_URL", "http://127.0.0.1:8000"))
    p.add_argument("--actuator", choices=("docker", "kubernetes"),
                   default=os.environ.get("PDSERVE_ACTUATOR", "docker"),
                   help="what starts and stops workers (PDSERVE_ACTUATOR)")
    p.add_argument("--project", default=os.environ.get("COMPOSE_PROJECT_NAME", "pdserve"),
                   help="the compose project whose prefill and decode services are scaled")
    p.add_argument("--docker-socket", default="/var/run/docker.sock")
    p.add_argument("--prefill", type=int, default=int(os.environ.get("PDSERVE_MIN_PREFILL", "1")),
                   help="minimum prefill workers (compose's own replicas count)")
    p.add_argument("--decode", type=int, default=int(os.environ.get("PDSERVE_MIN_DECODE", "1")),
                   help="minimum decode workers")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (default: the first of $PDSERVE_API_KEY, "
                        "$PDSERVE_API_KEY_FILE)")
    p.add_argument("--log-level", default="WARNING")
    add_kubernetes_args(p)
    add_autoscale_args(p)
    p.set_defaults(func=run_autoscaler)


def run_autoscaler(args: argparse.Namespace) -> int:
    asyncio.run(_main(args))
    return 0


async def _main(args: argparse.Namespace) -> None:
    from services.autoscaler.docker_actuator import DockerActuator
    from services.autoscaler.k8s_actuator import KubernetesActuator
    from services.autoscaler.loop import Autoscaler, AutoscalerOptions
    from services.autoscaler.observe import RouterObserver
    from services.autoscaler.planner import Planner

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    actuator: DockerActuator | KubernetesActuator
    if args.actuator == "docker":
        actuator = DockerActuator(args.project, socket_path=args.docker_socket)
        where = f"project {args.project}"
    else:
        actuator = await kubernetes_actuator(args)
        where = f"namespace {actuator.api.namespace}"
    observer = RouterObserver(args.router, first_api_key(args.api_key))
    scaler = Autoscaler(observer, Planner(planner_config(args)), actuator,
                        AutoscalerOptions(interval_s=args.autoscale_interval_s, log_path=args.autoscale_log))
    print(f"pdserve autoscaler: {args.actuator} actuator, {where}, router {args.router}, prefill "
          f"{args.prefill}..{args.max_prefill}, decode {args.decode}..{args.max_decode}", flush=True)
    try:
        await scaler.run(stop)
    finally:
        if args.actuator == "docker":  # the replicas it added go away with it (drained first)
            for role in ("prefill", "decode"):
                for target in actuator.managed(role):
                    await scaler.remove(role, target)
        # Kubernetes: the Deployments keep their replicas (as with an HPA removed); a restarted
        # autoscaler takes the pods over.
        await actuator.close()
        await observer.close()
