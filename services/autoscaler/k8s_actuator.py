"""The Kubernetes actuator: sizes the prefill / decode Deployments through their scale subresource
(never editing a Deployment's spec), as `kubectl scale` or an HPA would.

start(role): replicas + 1, then waits (bounded) for a pod of the Deployment (by its selector) that
was not there before to be Ready, and for its gRPC health to say SERVING; returns `podIP:port`.
If it never serves, the replica is given back (scaled down again: Kubernetes removes a pod that is
not ready before a ready one).
stop(role, target): the autoscaler loop has drained the worker through the router and removed it
there (services/autoscaler/loop.py); this marks that pod `controller.kubernetes.io/
pod-deletion-cost` below every other pod's, so the ReplicaSet removes exactly it, then replicas - 1,
and waits (bounded) until the pod is terminating. Its worker then drains what it still has on SIGTERM.
managed(role): every Ready pod of the role's Deployment, as listed at most `refresh_s` ago. In a
cluster the Deployment owns its pods and its replica count is the state: a restarted autoscaler
takes over the pods it added before; the planner's minimums are the floor. Nothing is scaled down
when the autoscaler exits (as with an HPA removed).

An API server that cannot be reached makes start/stop raise `KubernetesError` (the loop logs it
and tries again at its next step); the listing keeps its last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.autoscaler.actuators import wait_serving
from services.autoscaler.k8s_api import DELETION_COST, DEPLOYMENTS, PORTS, KubeApi, KubernetesError, Pod

logger = logging.getLogger(__name__)

LOWEST_COST = -(2**31)


class KubernetesActuator:
    def __init__(self, api: KubeApi, deployments: dict[str, str] | None = None,
                 ports: dict[str, int] | None = None, startup_timeout_s: float = 600.0,
                 stop_timeout_s: float = 60.0, refresh_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.api = api
        deployments = deployments or DEPLOYMENTS
        ports = ports or PORTS
        # colocated workers are the decode pool's, as in compose
        self.deployments = {**deployments, "colocated": deployments["decode"]}
        self.ports = {**ports, "colocated": ports["decode"]}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.refresh_s = refresh_s
        self.poll_s = poll_s
        self._ready: dict[str, list[str]] = {}  # deployment -> targets of its Ready pods
        # by deployment: the pods start() returned (or is returning), never handed out twice
        self._handed: dict[str, set[str]] = {d: set() for d in self.deployments.values()}
        self._refresher: asyncio.Task[None] | None = None

    # --- the Actuator interface ------------------------------------------------------------------
    async def start(self, role: str) -> str:
        deployment = self.deployments[role]
        deadline = time.monotonic() + self.startup_timeout_s
        selector = await self.api.selector(deployment)
        before = {p.name for p in await self.api.pods(selector)}
        replicas = await self.api.scale_by(deployment, +1)
        logger.warning("k8s actuator: scaled %s to %d", deployment, replicas)
        pod: Pod | None = None
        try:
            pod = await self._new_ready_pod(deployment, selector, before, deadline)
            target = pod.target(self.ports[role])
            await wait_serving(target, lambda: True, max(1.0, deadline - time.monotonic()))
        except BaseException as e:
            logger.warning("k8s actuator: %s did not serve (%s); scaling it back", deployment, e)
            with contextlib.suppress(KubernetesError):
                await self._scale_down(deployment, pod)
            raise
        logger.warning("k8s actuator: pod %s serves at %s", pod.name, target)
        with contextlib.suppress(KubernetesError):
            await self._refresh(deployment)
        return target

    async def stop(self, role: str, target: str) -> None:
        deployment, port = self.deployments[role], self.ports[role]
        pods = await self.api.pods(await self.api.selector(deployment))
        pod = next((p for p in pods if p.target(port) == target and not p.deleting), None)
        if pod is None:  # scaling down anyway would remove another pod, possibly busy
            logger.warning("k8s actuator: no pod of %s at %s any more; not scaling down", deployment, target)
        else:
            await self._scale_down(deployment, pod, pods)
            await self._wait_terminating(deployment, pod)
        with contextlib.suppress(KubernetesError):
            await self._refresh(deployment)

    def managed(self, role: str) -> list[str]:
        return list(self._ready.get(self.deployments[role], []))

    # --- lifecycle -----------------------------------------------------------------------------
    async def open(self) -> None:
        """Lists the pods now, then every `refresh_s` in the background (for `managed`)."""
        for deployment in set(self.deployments.values()):
            with contextlib.suppress(KubernetesError):
                await self._refresh(deployment)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        self.api.close()

    # --- helpers ---------------------------------------------------------------------------------
    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            for deployment in set(self.deployments.values()):
                try:
                    await self._refresh(deployment)
                except KubernetesError as e:  # keep the last listing; try again next time
                    logger.warning("k8s actuator: %s", e)

    async def _refresh(self, deployment: str) -> None:
        port = next(self.ports[r] for r, d in self.deployments.items() if d == deployment)
        handed = set(self._handed[deployment])  # a start() may hand out a pod newer than this listing
        pods = await self.api.pods(await self.api.selector(deployment))
        self._ready[deployment] = [p.target(port) for p in pods if p.ready and p.ip and not p.deleting]
        self._handed[deployment] -= handed - {p.name for p in pods}

    async def _new_ready_pod(self, deployment: str, selector: str, before: set[str], deadline: float) -> Pod:
        """A Ready pod that was not in `before` and that no other start() took."""
        handed = self._handed[deployment]
        while time.monotonic() < deadline:
            for pod in await self.api.pods(selector):
                if (pod.name not in before and pod.name not in handed and pod.ready and pod.ip
                        and not pod.deleting):
                    handed.add(pod.name)  # no await since the check: no other start() takes it
                    return pod
            await asyncio.sleep(self.poll_s)
        raise KubernetesError(f"no new Ready pod for selector {selector!r} in {self.startup_timeout_s:g} s")

    async def _scale_down(self, deployment: str, pod: Pod | None, pods: list[Pod] | None = None) -> None:
        """Marks `pod` as the cheapest to delete (below every other pod), then replicas - 1. With
        no pod, Kubernetes' own ranking picks (a pod not yet ready goes first)."""
        if pod is None:
            await self.api.scale_by(deployment, -1)
            return
        if pods is None:
            pods = await self.api.pods(await self.api.selector(deployment))
        others = [p.deletion_cost for p in pods if p.name != pod.name]
        cost = max(LOWEST_COST, min([-1000, *(c - 1 for c in others)]))
        await self.api.annotate(pod.name, {DELETION_COST: str(cost)})
        try:
            replicas = await self.api.scale_by(deployment, -1)
        except KubernetesError:  # left marked, the next scale-down by anyone would take this pod
            with contextlib.suppress(KubernetesError):
                await self.api.annotate(pod.name, {DELETION_COST: pod.annotations.get(DELETION_COST)})
            raise
        logger.warning("k8s actuator: scaled %s to %d, removing pod %s (deletion cost %d)",
                       deployment, replicas, pod.name, cost)

    async def _wait_terminating(self, deployment: str, pod: Pod) -> None:
        """Until the ReplicaSet has deleted `pod` (bounded); warns when it took another one."""
        deadline = time.monotonic() + self.stop_timeout_s
        selector = await self.api.selector(deployment)
        while time.monotonic() < deadline:
            now = {p.name: p for p in await self.api.pods(selector)}
            if pod.name not in now or now[pod.name].deleting:
                return
            await asyncio.sleep(self.poll_s)
        logger.warning("k8s actuator: pod %s of %s still runs %g s after scaling down (Kubernetes "
                       "removed a pod that was not ready instead?); the router gets it back",
                       pod.name, deployment, self.stop_timeout_s)
