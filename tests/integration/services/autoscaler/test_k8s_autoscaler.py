"""The autoscaler loop end to end with the Kubernetes actuator: a real router, real `pdserve worker`
processes (tiny model) as the pods of a FAKE Kubernetes API server (no cluster can run here;
fake_kube_api.py says what it simulates), each on its own loopback address and the Deployment's
port. Under load over the targets each Deployment grows by one pod through its scale subresource;
idle, with requests still flowing, each shrinks back: the pod the loop drained through the router
is the one marked with the lowest pod-deletion-cost and the one the "ReplicaSet" deletes, and no
request fails. One run grows and shrinks the decode Deployment (three worker processes in all),
the other both Deployments (four). Slow: about 110 s for the first on 2 busy cores."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes actuator needs the kubernetes client (pdserve[k8s])")

from kvstore.service import KVStoreService
from services.autoscaler.k8s_actuator import KubernetesActuator
from services.autoscaler.k8s_api import KubeApi, api_client
from services.autoscaler.loop import Autoscaler, AutoscalerOptions
from services.autoscaler.observe import RouterObserver
from services.autoscaler.planner import Planner, PlannerConfig
from services.procs import cli, stop_process
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from tests.integration.services.autoscaler.test_autoscaler import HUGE, MODEL, Load, until
from tests.integration.services.autoscaler.test_k8s_actuator import labels, write_kubeconfig
from tests.integration.services.fake_kube_api import COST, FakeKubeApi, wait_for
from tests.integration.services.router_util import ServedRouter

in_module_loop = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.slow
NS = "pdserve"
DEPLOYMENTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
PORTS = {"prefill": 23151, "decode": 23161}


class WorkerPod:
    """A pod's container: `pdserve worker` on the pod's address; SIGTERM on deletion (it drains).
    A plain Popen, not services.procs.spawn: its parent-death signal follows the thread that
    started the child, and the fake starts pods from short-lived threads."""

    def __init__(self, role: str, ip: str, port: int, worker_args: list[str], logs: Path) -> None:
        with open(logs / f"{role}-{ip}.log", "wb") as log:
            self.proc = subprocess.Popen(
                cli("worker", "--role", role, "--host", ip, "--port", str(port), *worker_args),
                stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout_s=30)


@pytest.fixture
def fake(model_dir: Path, store: KVStoreService, tmp_path: Path) -> Iterator[FakeKubeApi]:
    """The fake API server with one Ready prefill pod and one Ready decode pod."""
    args = ["--kv-store-url", store.location, "--model", str(model_dir), "--num-threads", "1",
            "--max-model-len", "512", "--num-kv-blocks", "96"]
    roles = {d: r for r, d in DEPLOYMENTS.items()}
    with FakeKubeApi(NS, {d: (labels(r), PORTS[r]) for r, d in DEPLOYMENTS.items()},
                     lambda d, ip, port: WorkerPod(roles[d], ip, port, args, tmp_path)) as api:
        for d in DEPLOYMENTS.values():
            api.scale(d, 1)
        try:
            wait_for(lambda: len(api.pods) == 2 and all(p.ready for p in api.pods.values()), 120,
                     "the first prefill and decode pods Ready")
        except AssertionError:
            for log in tmp_path.glob("*.log"):
                print(log.name, log.read_text()[-2000:])
            raise
        yield api


def targets(fake: FakeKubeApi, role: str) -> set[str]:
    return {f"{p.ip}:{p.port}" for p in fake.live_pods(DEPLOYMENTS[role])}


@in_module_loop
@pytest.mark.parametrize("grow", [pytest.param(("decode",), id="decode"),
                                  pytest.param(("prefill", "decode"), id="both")])
async def test_deployments_follow_the_load_and_shrink_by_draining_the_pod_removed(
        grow: tuple[str, ...], fake: FakeKubeApi, model_dir: Path, tmp_path: Path) -> None:
    dispatch = DispatchOptions(prefill=tuple(targets(fake, "prefill")), decode=tuple(targets(fake, "decode")),
                               prefill_policy="least_loaded", decode_policy="least_loaded")
    base = PlannerConfig(ttft_ms=HUGE, itl_ms=HUGE, min_prefill=1, max_prefill=2, min_decode=1, max_decode=2,
                         prefill_tokens_per_s=1e9, up_intervals=2, down_intervals=3, up_cooldown_s=1,
                         down_cooldown_s=2)
    over = replace(base, ttft_ms=1.0 if "prefill" in grow else HUGE, itl_ms=1.0 if "decode" in grow else HUGE)
    api = KubeApi(api_client(str(write_kubeconfig(tmp_path / "kubeconfig", fake.url))), NS)
    actuator = KubernetesActuator(api, DEPLOYMENTS, PORTS, startup_timeout_s=120, refresh_s=0.5, poll_s=0.2)
    await actuator.open()
    router_config = RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch,
                                 worker_networks=("127.0.0.0/8",))  # the fake's pods: 127.0.23.N
    with ServedRouter(router_config) as served:
        observer = RouterObserver(served.url)
        planner = Planner(over)
        scaler = Autoscaler(observer, planner, actuator, AutoscalerOptions(interval_s=0.5))
        stop = asyncio.Event()
        loop = asyncio.create_task(scaler.run(stop))
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=60)

        def replicas() -> dict[str, int]:
            return {r: fake.deployments[d].replicas for r, d in DEPLOYMENTS.items()}

        async def in_router(role: str) -> set[str]:
            return {w["target"] for w in await observer.workers() if w["role"] == role and w["healthy"]}

        grown = {r: 2 if r in grow else 1 for r in DEPLOYMENTS}
        failed: list[str] = []
        loads: list[Load] = []
        try:
            # 1. Over the targets: the Deployments in `grow` get one more pod, registered in the router.
            load = Load(client, users=6, prompt=[5, 6, 7, 8], max_tokens=16)
            loads.append(load)
            # The actuator lists a new pod once it is Ready (every refresh_s), before the loop has
            # registered it in the router and seen its first load report there: the scale-up is
            # over when nothing is starting any more.
            await until(scaler, lambda: {r: len(actuator.managed(r)) for r in DEPLOYMENTS} == grown
                        and not any(scaler.starting.values()), 120, f"{grow} grown to 2")
            assert replicas() == grown
            for role in DEPLOYMENTS:
                assert await in_router(role) == targets(fake, role)
            await load.stop()
            failed += load.failed

            # 2. Idle but for a trickle: each shrinks to one, deleting the pod it drained.
            planner.config = base
            trickle = Load(client, users=1, prompt=[9, 9, 9], max_tokens=24)
            loads.append(trickle)
            await until(scaler, lambda: replicas() == {"prefill": 1, "decode": 1}
                        and len(fake.deleted) == len(grow), 90, "shrunk to 1 + 1")
            await trickle.stop()
            failed += trickle.failed
            for role in DEPLOYMENTS:
                assert await in_router(role) == targets(fake, role)  # the drained pod left, the other stays
            for name in fake.deleted:
                assert int(fake.annotations_when_deleted[name][COST]) <= -1000
        finally:
            for running in loads:  # stopped twice is harmless
                await running.stop()
            stop.set()
            await asyncio.wait_for(loop, timeout=120)
            await actuator.close()
            await observer.close()
            await client.close()
        assert failed == []
