"""The Kubernetes actuator through the official client against a FAKE API server (no cluster can
run here; tests/integration/services/fake_kube_api.py says what it simulates), whose pods are gRPC
health servers on their own loopback addresses: scaling up returns a pod's serving podIP:port;
stopping removes exactly the named pod (marked with the lowest pod-deletion-cost) and no other;
a scale that races another writer (409) is re-read and retried; a pod that never serves is given
back; an API server that cannot be reached is a clear error, and the listing survives it;
`pdserve autoscaler --actuator kubernetes` runs from a kubeconfig and leaves the replicas on exit."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("kubernetes", reason="the Kubernetes actuator needs the kubernetes client (pdserve[k8s])")

from services.autoscaler.k8s_actuator import KubernetesActuator
from services.autoscaler.k8s_api import ConflictError, KubeApi, KubernetesError, api_client
from services.procs import cli, stop_process
from tests.integration.services.fake_kube_api import (
    COST,
    FakeKubeApi,
    HealthServer,
    grpc_serving,
    wait_for,
)

NS = "pdserve"
PREFILL, DECODE = "pdserve-prefill", "pdserve-decode"
PORTS = {"prefill": 23051, "decode": 23061}
NEVER_SERVES = "never"  # a deployment whose pods start nothing


class NoServer:
    def stop(self) -> None:
        pass


def backend(deployment: str, ip: str, port: int) -> HealthServer | NoServer:
    return NoServer() if deployment == NEVER_SERVES else HealthServer(ip, port)


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig as `kubectl config` writes one, naming the fake server."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server}"}}}}]
users: [{{name: fake, user: {{token: fake-token}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: {NS}}}}}]
current-context: fake
""")
    return path


@pytest.fixture
def fake() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(NS, {PREFILL: (labels("prefill"), PORTS["prefill"]),
                          DECODE: (labels("decode"), PORTS["decode"]),
                          NEVER_SERVES: (labels("never"), 23071)}, backend) as api:
        api.scale(PREFILL, 1)
        api.scale(DECODE, 1)
        wait_for(lambda: all(p.ready for p in api.pods.values()), 10, "the first pods Ready")
        yield api


@pytest_asyncio.fixture
async def actuator(fake: FakeKubeApi, tmp_path: Path) -> AsyncIterator[KubernetesActuator]:
    api = KubeApi(api_client(str(write_kubeconfig(tmp_path / "kubeconfig", fake.url))), NS)
    act = KubernetesActuator(api, {"prefill": PREFILL, "decode": DECODE}, PORTS, startup_timeout_s=20,
                             stop_timeout_s=10, refresh_s=0.2, poll_s=0.05)
    await act.open()
    try:
        yield act
    finally:
        await act.close()


async def test_start_scales_up_by_one_and_returns_the_new_pods_serving_target(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    first = actuator.managed("prefill")
    target = await actuator.start("prefill")
    assert fake.deployments[PREFILL].replicas == 2
    new = [p for p in fake.live_pods(PREFILL) if f"{p.ip}:{p.port}" == target]
    assert len(new) == 1 and target not in first and target.endswith(":23051")
    assert await asyncio.to_thread(grpc_serving, target)
    assert sorted(actuator.managed("prefill")) == sorted([*first, target])
    assert fake.deployments[DECODE].replicas == 1  # the other pool is left alone
    assert ("PUT", f"/apis/apps/v1/namespaces/{NS}/deployments/{PREFILL}/scale") in fake.requests


async def test_concurrent_starts_get_distinct_pods(actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    targets = await asyncio.gather(actuator.start("decode"), actuator.start("decode"))
    assert len(set(targets)) == 2
    assert fake.deployments[DECODE].replicas == 3


async def test_stop_removes_exactly_that_pod_marked_cheapest_to_delete(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    added = [await actuator.start("prefill") for _ in range(2)]
    pods = {f"{p.ip}:{p.port}": p.name for p in fake.live_pods(PREFILL)}
    victim = added[0]  # neither the newest nor the oldest: Kubernetes would not pick it by itself
    await actuator.stop("prefill", victim)
    assert fake.deployments[PREFILL].replicas == 2
    assert fake.deleted == [pods[victim]]
    assert int(fake.annotations_when_deleted[pods[victim]][COST]) <= -1000
    left = {f"{p.ip}:{p.port}" for p in fake.live_pods(PREFILL)}
    assert left == set(pods) - {victim}
    assert victim not in actuator.managed("prefill")
    assert all(COST not in p.annotations for p in fake.live_pods(PREFILL))  # the others keep theirs


async def test_the_mark_goes_below_every_other_pods_cost(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    target = await actuator.start("prefill")
    first = next(p for p in fake.live_pods(PREFILL) if f"{p.ip}:{p.port}" != target)
    first.annotations[COST] = "-5000"  # an operator's own ranking
    await actuator.stop("prefill", target)
    assert fake.deleted and fake.deleted[0] != first.name
    assert int(fake.annotations_when_deleted[fake.deleted[0]][COST]) < -5000


async def test_a_scale_that_races_another_writer_is_reread_and_retried(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    fake.interfere(3)
    await actuator.start("prefill")
    assert fake.conflicts_answered == 3
    # the other writer's own count is what the retry built on (the fake's writer keeps replicas)
    assert fake.deployments[PREFILL].replicas == 2
    fake.interfere(1000)
    api = KubeApi(actuator.api._api, NS, conflict_retries=3)
    with pytest.raises(ConflictError, match="conflicted 3 times"):
        await api.scale_by(PREFILL, 1)
    assert fake.deployments[PREFILL].replicas == 2


async def test_a_pod_that_never_serves_is_given_back(fake: FakeKubeApi, tmp_path: Path) -> None:
    fake.scale(NEVER_SERVES, 1)
    api = KubeApi(api_client(str(write_kubeconfig(tmp_path / "kubeconfig", fake.url))), NS)
    act = KubernetesActuator(api, {"prefill": NEVER_SERVES, "decode": DECODE},
                             {"prefill": 23071, "decode": 1}, startup_timeout_s=1.5, poll_s=0.05)
    try:
        with pytest.raises(KubernetesError, match="no new Ready pod"):
            await act.start("prefill")
        assert fake.deployments[NEVER_SERVES].replicas == 1
        assert len(fake.live_pods(NEVER_SERVES)) == 1
    finally:
        await act.close()


async def test_stopping_a_pod_that_vanished_scales_nothing_down(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    await actuator.stop("prefill", "127.0.23.250:23051")
    assert fake.deployments[PREFILL].replicas == 1 and fake.deleted == []


async def test_an_unreachable_api_server_is_a_clear_error_and_the_listing_survives(
        actuator: KubernetesActuator, fake: FakeKubeApi) -> None:
    known = actuator.managed("prefill")
    fake.server.shutdown()
    fake.server.server_close()
    t0 = time.monotonic()
    with pytest.raises(KubernetesError, match=rf"API server {fake.url} unreachable"):
        await actuator.start("prefill")
    with pytest.raises(KubernetesError, match="unreachable"):
        await actuator.stop("prefill", known[0])
    assert time.monotonic() - t0 < 10
    await asyncio.sleep(0.5)  # a few background listings fail
    assert actuator.managed("prefill") == known
    assert actuator._refresher is not None and not actuator._refresher.done()


def test_the_cli_runs_the_kubernetes_actuator_and_leaves_the_replicas_on_exit(
        fake: FakeKubeApi, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    proc = subprocess.Popen(cli("autoscaler", "--actuator", "kubernetes", "--kubeconfig", str(kubeconfig),
                                "--namespace", NS, "--prefill-deployment", PREFILL, "--decode-deployment",
                                DECODE, "--prefill-port", "23051", "--decode-port", "23061",
                                "--router", "http://127.0.0.1:1", "--autoscale-interval-s", "0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith(f"pdserve autoscaler: kubernetes actuator, namespace {NS}"), first
        wait_for(lambda: ("GET", f"/api/v1/namespaces/{NS}/pods") in fake.requests, 30, "a pod listing")
    finally:
        code = stop_process(proc, signal.SIGTERM, timeout_s=30)
    assert code == 0
    assert fake.deployments[PREFILL].replicas == 1 and fake.deployments[DECODE].replicas == 1
