"""`pdserve autoscaler --actuator kubernetes`: its flags, and the actuator they describe."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from services.autoscaler.k8s_api import DEPLOYMENTS, PORTS

if TYPE_CHECKING:
    from services.autoscaler.k8s_actuator import KubernetesActuator


def add_kubernetes_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kubernetes (--actuator kubernetes; needs pip install 'pdserve[k8s]')")
    g.add_argument("--namespace", default=os.environ.get("PDSERVE_NAMESPACE") or None,
                   help="the namespace of the Deployments (default: this pod's own, else 'default')")
    g.add_argument("--prefill-deployment", default=DEPLOYMENTS["prefill"])
    g.add_argument("--decode-deployment", default=DEPLOYMENTS["decode"])
    g.add_argument("--prefill-port", type=int, default=PORTS["prefill"],
                   help="the prefill workers' gRPC port in their pods")
    g.add_argument("--decode-port", type=int, default=PORTS["decode"])
    g.add_argument("--kubeconfig", default=None,
                   help="a kubeconfig file (default: the pod's service account inside a cluster, "
                        "else $KUBECONFIG or ~/.kube/config)")
    g.add_argument("--kube-context", default=None, help="the kubeconfig context (default: its current one)")


async def kubernetes_actuator(args: Any) -> KubernetesActuator:
    """The actuator the flags describe, with its pod listing started."""
    from services.autoscaler.k8s_actuator import KubernetesActuator
    from services.autoscaler.k8s_api import KubeApi, api_client, default_namespace

    api = KubeApi(api_client(args.kubeconfig, args.kube_context), args.namespace or default_namespace())
    actuator = KubernetesActuator(api, {"prefill": args.prefill_deployment, "decode": args.decode_deployment},
                                  {"prefill": args.prefill_port, "decode": args.decode_port})
    await actuator.open()
    return actuator
