"""The few Kubernetes API calls the Kubernetes actuator makes, over the official `kubernetes` client
(the optional extra `pdserve[k8s]`; imported only when this module is used):

- a Deployment's scale subresource (autoscaling/v1 Scale): read it, and change spec.replicas by
  read-modify-replace with the read resourceVersion, so a concurrent writer (kubectl scale,
  another autoscaler) answers 409 Conflict and the change is re-read and retried (bounded);
- the pods of a Deployment, by the label selector its Scale reports;
- a merge patch of one pod's annotations.

The client is synchronous (urllib3); each call runs in a thread with a bounded request timeout.
Every failure comes out as `KubernetesError` with a message naming the call and the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DEPLOYMENTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}  # the manifests' names
PORTS = {"prefill": 50051, "decode": 50061}
T = TypeVar("T")


class KubernetesError(RuntimeError):
    """A Kubernetes API call failed (unreachable, refused, or an error status)."""


class ConflictError(KubernetesError):
    """409 Conflict: the object changed since it was read."""


@dataclass(frozen=True)
class Pod:
    """What the actuator needs of a pod, as plain values."""

    name: str
    ip: str  # "" until the pod has an address
    ready: bool  # its Ready condition is True
    deleting: bool  # it has a deletionTimestamp (terminating)
    created: datetime
    annotations: dict[str, str]

    def target(self, port: int) -> str:
        """podIP:port (an IPv6 address in brackets)."""
        return f"[{self.ip}]:{port}" if ":" in self.ip else f"{self.ip}:{port}"

    @property
    def deletion_cost(self) -> int:
        try:
            return int(self.annotations.get(DELETION_COST, "0"))
        except ValueError:  # the API server rejects such a value; count it as the default
            return 0


def default_namespace() -> str:
    """The namespace of this pod's service account, else "default"."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ApiClient from the pod's service account when running in a cluster (and no kubeconfig
    is named), else from the kubeconfig file ($KUBECONFIG, ~/.kube/config)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesError("the Kubernetes actuator needs the kubernetes client: "
                              "pip install 'pdserve[k8s]'") from None
    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, context=context,
                                client_configuration=configuration)
    configuration.retries = 1  # fail fast; the autoscaler's next step tries again
    return client.ApiClient(configuration)


class KubeApi:
    def __init__(self, api: Any, namespace: str, timeout_s: float = 10.0,
                 conflict_retries: int = 8) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.timeout_s = timeout_s
        self.conflict_retries = conflict_retries
        self.host = api.configuration.host
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self._api = api

    def close(self) -> None:
        self._api.close()

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=self.timeout_s, **kw)
        except ApiException as e:
            error = ConflictError if e.status == 409 else KubernetesError
            raise error(f"kubernetes {what}: {e.status} {e.reason}: {_message(e.body)}") from None
        except (HTTPError, OSError) as e:
            raise KubernetesError(f"kubernetes {what}: API server {self.host} unreachable: "
                                  f"{type(e).__name__}: {e}") from None

    async def read_scale(self, deployment: str) -> Any:
        """The Deployment's autoscaling/v1 Scale (spec.replicas, status.selector, resourceVersion)."""
        return await self._call(f"read scale of deployment {self.namespace}/{deployment}",
                                self.apps.read_namespaced_deployment_scale, deployment, self.namespace)

    async def selector(self, deployment: str) -> str:
        """The label selector of the Deployment's pods (as its Scale reports it)."""
        selector = (await self.read_scale(deployment)).status.selector
        if not selector:
            raise KubernetesError(f"deployment {self.namespace}/{deployment} reports no pod selector")
        return str(selector)

    async def scale_by(self, deployment: str, delta: int) -> int:
        """Changes the Deployment's replicas by `delta` (never below 0); returns the new count.
        A 409 (someone else changed it since it was read) is re-read and retried."""
        for attempt in range(self.conflict_retries):
            scale = await self.read_scale(deployment)
            scale.spec.replicas = max(0, (scale.spec.replicas or 0) + delta)
            try:
                await self._call(f"scale deployment {self.namespace}/{deployment} to "
                                 f"{scale.spec.replicas}", self.apps.replace_namespaced_deployment_scale,
                                 deployment, self.namespace, scale)
                return int(scale.spec.replicas)
            except ConflictError as e:
                logger.warning("k8s actuator: %s; re-reading (try %d)", e, attempt + 1)
                await asyncio.sleep(random.uniform(0.02, 0.1) * (attempt + 1))  # spread the racers
        raise ConflictError(f"kubernetes: scaling deployment {self.namespace}/{deployment} by {delta} "
                            f"conflicted {self.conflict_retries} times in a row")

    async def pods(self, selector: str) -> list[Pod]:
        found = await self._call(f"list pods {selector!r} in {self.namespace}",
                                 self.core.list_namespaced_pod, self.namespace, label_selector=selector)
        return [_pod(p) for p in found.items]

    async def annotate(self, pod: str, annotations: dict[str, str | None]) -> None:
        """Merge-patches the pod's annotations (None removes one)."""
        await self._call(f"annotate pod {self.namespace}/{pod}", self.core.patch_namespaced_pod, pod,
                         self.namespace, {"metadata": {"annotations": annotations}},
                         _content_type="application/merge-patch+json")


def _pod(p: Any) -> Pod:
    status = p.status
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    return Pod(name=p.metadata.name, ip=status.pod_ip or "", ready=ready and status.phase == "Running",
               deleting=p.metadata.deletion_timestamp is not None,
               created=p.metadata.creation_timestamp, annotations=dict(p.metadata.annotations or {}))


def _message(body: Any) -> str:
    """The `message` of a Status body, else the body's start."""
    import json

    try:
        return str(json.loads(body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(body)[:200]
