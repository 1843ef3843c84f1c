"""A FAKE Kubernetes API server, because no cluster can run here: a small HTTP server on loopback
that speaks the few calls the Kubernetes actuator makes, with the real API's paths and JSON shapes,
and plays the ReplicaSet controller and the kubelet for the pods:

    GET/PUT/PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   autoscaling/v1 Scale
    GET           /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...        v1 PodList
    PATCH         /api/v1/namespaces/{ns}/pods/{name}                       metadata.annotations
                                                                            (merge patches only)

Scaling up creates pods (not ready) and starts a backend for each: a process or server listening
on the pod's own loopback address (127.0.23.N) and the Deployment's port, as pods share a port on
different IPs; the "kubelet" marks a pod Ready once its gRPC health says SERVING. Scaling down
picks pods as Kubernetes ranks them (not ready first, then the lowest
controller.kubernetes.io/pod-deletion-cost, then the newest), marks them terminating, stops their
backend (SIGTERM) and deletes them. A PUT or PATCH whose resourceVersion is stale answers 409
Conflict as the real server does; `interfere(n)` makes the next n scale writes lose such a race
(another writer changes the Scale first). Not simulated: authentication, watches, rollouts, other
resources, set-based selectors, strategic-merge semantics beyond plain maps.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
COST = "controller.kubernetes.io/pod-deletion-cost"


class Backend(Protocol):
    def stop(self) -> None: ...


StartBackend = Callable[[str, str, int], Backend]  # (deployment, ip, port) -> the pod's server


@dataclass
class FakePod:
    name: str
    deployment: str
    labels: dict[str, str]
    ip: str
    port: int
    created: datetime
    annotations: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    deleted_at: datetime | None = None
    backend: Backend | None = None
    resource_version: int = 1

    def to_json(self, namespace: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": namespace, "uid": f"uid-{self.name}",
                                "resourceVersion": str(self.resource_version), "labels": self.labels,
                                "annotations": self.annotations, "creationTimestamp": _ts(self.created)}
        if self.deleted_at is not None:
            meta["deletionTimestamp"] = _ts(self.deleted_at)
        ready = "True" if self.ready and self.deleted_at is None else "False"
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"containers": [{"name": "worker", "image": "pdserve:fake",
                                         "ports": [{"containerPort": self.port}]}]},
                "status": {"phase": "Running" if self.backend else "Pending", "podIP": self.ip,
                           "podIPs": [{"ip": self.ip}],
                           "conditions": [{"type": "Ready", "status": ready}]}}


@dataclass
class FakeDeployment:
    name: str
    labels: dict[str, str]
    port: int
    replicas: int = 0
    resource_version: int = 1

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))


class FakeKubeApi:
    """`with FakeKubeApi("pdserve", {"pdserve-prefill": (labels, port)}, start_backend) as api:`
    serves on http://127.0.0.1:{api.port}; `api.scale(name, n)` sets replicas as kubectl would."""

    def __init__(self, namespace: str, deployments: dict[str, tuple[dict[str, str], int]],
                 start_backend: StartBackend, port: int = 0) -> None:
        self.namespace = namespace
        self.deployments = {name: FakeDeployment(name, labels, p)
                            for name, (labels, p) in deployments.items()}
        self.pods: dict[str, FakePod] = {}
        self.start_backend = start_backend
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.deleted: list[str] = []  # pod names, in the order the "ReplicaSet" removed them
        self.annotations_when_deleted: dict[str, dict[str, str]] = {}
        self.conflicts_answered = 0
        self._interfere = 0
        self._ips = (f"127.0.23.{n}" for n in itertools.count(2))
        self._names = itertools.count(1)
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                         threading.Thread(target=self._kubelet, daemon=True)]

    def __enter__(self) -> FakeKubeApi:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            pods = list(self.pods.values())
            self.pods.clear()
        stopping = [threading.Thread(target=p.backend.stop) for p in pods if p.backend is not None]
        for t in stopping:  # in parallel: a worker takes seconds to shut down
            t.start()
        for t in stopping:
            t.join()

    def interfere(self, n: int) -> None:
        """The next `n` scale writes lose a race: another writer changes the Scale just before."""
        self._interfere = n

    def scale(self, deployment: str, replicas: int) -> None:
        with self.lock:
            d = self.deployments[deployment]
            d.replicas, d.resource_version = replicas, d.resource_version + 1
        self._reconcile(d)

    def live_pods(self, deployment: str) -> list[FakePod]:
        with self.lock:
            return [p for p in self.pods.values() if p.deployment == deployment and p.deleted_at is None]

    # --- the "ReplicaSet controller" and "kubelet" ------------------------------------------------
    def _reconcile(self, d: FakeDeployment) -> None:
        with self.lock:
            live = self.live_pods(d.name)
            for _ in range(d.replicas - len(live)):
                pod = FakePod(f"{d.name}-{next(self._names):04d}", d.name, dict(d.labels), next(self._ips),
                              d.port, datetime.now(UTC))
                self.pods[pod.name] = pod
                threading.Thread(target=self._run_pod, args=(pod,), daemon=True).start()
            victims = sorted(live, key=lambda p: (p.ready, _cost(p), -p.created.timestamp()))
            for pod in victims[:max(0, len(live) - d.replicas)]:
                pod.deleted_at, pod.resource_version = datetime.now(UTC), pod.resource_version + 1
                self.deleted.append(pod.name)
                self.annotations_when_deleted[pod.name] = dict(pod.annotations)
                threading.Thread(target=self._delete_pod, args=(pod,), daemon=True).start()

    def _run_pod(self, pod: FakePod) -> None:
        try:
            backend = self.start_backend(pod.deployment, pod.ip, pod.port)
        except Exception as e:  # stays Pending, as a pod that cannot start
            print(f"fake kube api: pod {pod.name} did not start: {e}", flush=True)
            return
        with self.lock:
            pod.backend = backend
            if pod.deleted_at is None:
                return
        backend.stop()  # deleted while it started

    def _delete_pod(self, pod: FakePod) -> None:
        if pod.backend is not None:
            pod.backend.stop()  # SIGTERM, as the kubelet does after a pod's deletion
        with self.lock:
            self.pods.pop(pod.name, None)

    def _kubelet(self) -> None:
        """Readiness probes: a pod is Ready once its backend's gRPC health says SERVING."""
        while not self._stop.wait(0.2):
            with self.lock:
                waiting = [p for p in self.pods.values() if p.backend and not p.ready and not p.deleted_at]
            for pod in waiting:
                if grpc_serving(f"{pod.ip}:{pod.port}"):
                    with self.lock:
                        pod.ready, pod.resource_version = True, pod.resource_version + 1

    # --- the API ------------------------------------------------------------------------------
    def handle(self, method: str, url: str, content_type: str, body: bytes) -> tuple[int, dict[str, Any]]:
        parts = urlsplit(url)
        self.requests.append((method, parts.path))
        if m := SCALE.match(parts.path):
            return self._scale(method, m[1], m[2], content_type, body)
        if (m := PODS.match(parts.path)) and method == "GET":
            return self._list_pods(m[1], parse_qs(parts.query).get("labelSelector", [""])[0])
        if (m := POD.match(parts.path)) and method == "PATCH":
            return self._patch_pod(m[1], m[2], content_type, body)
        return _status(404, "NotFound", f"the fake API server does not serve {method} {parts.path}")

    def _scale(self, method: str, ns: str, name: str, content_type: str,
               body: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            d = self.deployments.get(name) if ns == self.namespace else None
            if d is None:
                return _status(404, "NotFound", f'deployments.apps "{name}" not found')
            if method == "GET":
                return 200, self._scale_json(d)
            if method == "PATCH" and content_type not in MERGE_PATCHES:
                return _status(415, "UnsupportedMediaType", f"merge patches only, not {content_type}")
            if method not in ("PUT", "PATCH"):
                return _status(405, "MethodNotAllowed", f"{method} on a Scale")
            sent = json.loads(body)
            if self._interfere > 0:
                self._interfere -= 1
                d.resource_version += 1  # another writer got there first
            version = sent.get("metadata", {}).get("resourceVersion")
            if version is not None and version != str(d.resource_version):
                self.conflicts_answered += 1
                return _status(409, "Conflict",
                               f'Operation cannot be fulfilled on deployments.apps "{name}": the object '
                               "has been modified; please apply your changes to the latest version and "
                               "try again")
            replicas = sent.get("spec", {}).get("replicas", d.replicas if method == "PATCH" else 0)
            d.replicas, d.resource_version = int(replicas), d.resource_version + 1
        self._reconcile(d)
        return 200, self._scale_json(d)

    def _scale_json(self, d: FakeDeployment) -> dict[str, Any]:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": d.name, "namespace": self.namespace, "uid": f"uid-{d.name}",
                             "resourceVersion": str(d.resource_version),
                             "creationTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"replicas": d.replicas},
                "status": {"replicas": len(self.live_pods(d.name)), "selector": d.selector}}

    def _list_pods(self, ns: str, selector: str) -> tuple[int, dict[str, Any]]:
        try:
            wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        except ValueError:
            return _status(400, "BadRequest", f"the fake takes k=v selectors only, got {selector!r}")
        with self.lock:
            items = [p.to_json(ns) for p in sorted(self.pods.values(), key=lambda p: p.name)
                     if ns == self.namespace and all(p.labels.get(k) == v for k, v in wanted.items())]
        return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
                     "items": items}

    def _patch_pod(self, ns: str, name: str, content_type: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if content_type not in MERGE_PATCHES:
            return _status(415, "UnsupportedMediaType", f"the fake takes merge patches, not {content_type}")
        with self.lock:
            pod = self.pods.get(name) if ns == self.namespace else None
            if pod is None:
                return _status(404, "NotFound", f'pods "{name}" not found')
            for key, value in json.loads(body).get("metadata", {}).get("annotations", {}).items():
                if value is None:
                    pod.annotations.pop(key, None)
                else:
                    pod.annotations[key] = str(value)
            pod.resource_version += 1
            return 200, pod.to_json(ns)


def grpc_serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class HealthServer:
    """A pod backend that is only a gRPC health server saying SERVING (for the actuator's tests)."""

    def __init__(self, ip: str, port: int) -> None:
        from concurrent import futures

        from grpc_health.v1 import health

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        self.server.add_insecure_port(f"{ip}:{port}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0).wait()


def _cost(pod: FakePod) -> int:
    try:
        return int(pod.annotations.get(COST, "0"))
    except ValueError:
        return 0


def _ts(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}


def _handler(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            code, reply = api.handle(self.command, self.path, content_type, body)
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        time.sleep(0.05)
