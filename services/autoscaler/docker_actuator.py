"""The Docker actuator: scales a compose project's prefill / decode services through the Docker
Engine API (HTTP over /var/run/docker.sock), as `docker compose up --scale` would.

start(role): takes a running replica of the service as the template, creates a container with its
image, entrypoint, command, environment, mounts, init and shm settings, the compose labels with the
next container number (so `docker compose ps` / `down` see it) plus `pdserve.autoscaler=1`, on the
same network with the service name as alias (so the router's dns: discovery finds it), starts it,
and returns `ip:port` once its gRPC health says SERVING.
stop(role, target): stops (SIGTERM, the worker drains) and removes a container it started.
managed(role): the running containers it started. Replicas compose started itself are never
stopped here, so the pool never shrinks below what compose runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from services.autoscaler.actuators import wait_serving

logger = logging.getLogger(__name__)

PROJECT = "com.docker.compose.project"
SERVICE = "com.docker.compose.service"
NUMBER = "com.docker.compose.container-number"
MINE = "pdserve.autoscaler"


class DockerError(RuntimeError):
    pass


class DockerActuator:
    def __init__(self, project: str, services: dict[str, str] | None = None,
                 ports: dict[str, int] | None = None, socket_path: str = "/var/run/docker.sock",
                 startup_timeout_s: float = 600.0, stop_timeout_s: int = 60) -> None:
        self.project = project
        self.services = services or {"prefill": "prefill", "decode": "decode", "colocated": "decode"}
        self.ports = ports or {"prefill": 50051, "decode": 50061, "colocated": 50061}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                      base_url="http://docker", timeout=60)
        self._targets: dict[str, tuple[str, str]] = {}  # target -> (role, container id)

    async def close(self) -> None:
        await self.http.aclose()

    async def _api(self, method: str, path: str, **kw: Any) -> Any:
        reply = await self.http.request(method, path, **kw)
        if reply.status_code >= 300:
            raise DockerError(f"docker {method} {path}: {reply.status_code} {reply.text[:300]}")
        return reply.json() if reply.content else None

    async def _containers(self, role: str, mine_only: bool = False) -> list[dict[str, Any]]:
        labels = [f"{PROJECT}={self.project}", f"{SERVICE}={self.services[role]}"]
        if mine_only:
            labels.append(f"{MINE}=1")
        found: list[dict[str, Any]] = await self._api(
            "GET", "/containers/json", params={"filters": json.dumps({"label": labels})})
        return found

    async def start(self, role: str) -> str:
        running = await self._containers(role)
        if not running:
            raise DockerError(f"no running {self.services[role]} container of project {self.project} "
                              f"to copy")
        template = await self._api("GET", f"/containers/{running[0]['Id']}/json")
        number = 1 + max(int(c["Labels"].get(NUMBER, "0")) for c in running)
        config, host = template["Config"], template["HostConfig"]
        network = next(iter(template["NetworkSettings"]["Networks"]))
        service = self.services[role]
        name = f"{self.project}-{service}-{number}"
        body = {
            "Image": config["Image"], "Entrypoint": config.get("Entrypoint"), "Cmd": config.get("Cmd"),
            "Env": config.get("Env"), "User": config.get("User", ""),
            "WorkingDir": config.get("WorkingDir", ""), "Healthcheck": config.get("Healthcheck"),
            "Labels": {**config.get("Labels", {}), NUMBER: str(number), MINE: "1",
                       "com.docker.compose.oneoff": "False"},
            "HostConfig": {key: host.get(key) for key in ("Binds", "Mounts", "Init", "ShmSize",
                                                          "NetworkMode", "RestartPolicy")},
            "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": [service, name]}}},
        }
        created = await self._api("POST", "/containers/create", params={"name": name}, json=body)
        cid = created["Id"]
        await self._api("POST", f"/containers/{cid}/start")
        info = await self._api("GET", f"/containers/{cid}/json")
        ip = info["NetworkSettings"]["Networks"][network]["IPAddress"]
        target = f"{ip}:{self.ports[role]}"
        self._targets[target] = (role, cid)
        logger.warning("docker actuator: started %s (%s) at %s", name, cid[:12], target)
        try:
            await wait_serving(target, lambda: True, self.startup_timeout_s)
        except BaseException:
            await self.stop(role, target)
            raise
        return target

    async def stop(self, role: str, target: str) -> None:
        entry = self._targets.pop(target, None)
        if entry is None:
            return
        cid = entry[1]
        try:
            await self._api("POST", f"/containers/{cid}/stop", params={"t": self.stop_timeout_s},
                            timeout=self.stop_timeout_s + 30)
        except DockerError as e:
            logger.warning("docker actuator: stopping %s: %s", cid[:12], e)
        await self._api("DELETE", f"/containers/{cid}", params={"force": "true"})
        logger.warning("docker actuator: removed %s (%s)", cid[:12], target)

    def managed(self, role: str) -> list[str]:
        return [t for t, (r, _) in self._targets.items() if r == role]

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r, t) for t, (r, _) in list(self._targets.items())))
