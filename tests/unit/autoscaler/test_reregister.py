"""A restarted router knows only the workers on its command line: the autoscaler registers its own
workers again, but never one it is adding or draining (a change in progress)."""

from __future__ import annotations

import json

import httpx

from services.autoscaler.loop import Autoscaler
from services.autoscaler.observe import RouterObserver
from services.autoscaler.planner import Planner, PlannerConfig


class Actuator:
    def __init__(self, managed: dict[str, list[str]]) -> None:
        self._managed = managed

    async def start(self, role: str) -> str:
        raise AssertionError("not started here")

    async def stop(self, role: str, target: str) -> None:
        raise AssertionError("not stopped here")

    def managed(self, role: str) -> list[str]:
        return self._managed.get(role, [])


async def test_workers_the_router_forgot_are_registered_again() -> None:
    listed = [{"role": "prefill", "target": "h:1", "healthy": True}]
    posted: list[dict[str, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"workers": listed})
        posted.append(json.loads(request.content))
        return httpx.Response(200, json={})

    observer = RouterObserver("http://router")
    observer.http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    scaler = Autoscaler(observer, Planner(PlannerConfig(ttft_ms=1000, itl_ms=100)),
                        Actuator({"prefill": ["h:1", "h:2"], "decode": ["h:3"]}))
    try:
        await scaler._reregister()
        assert sorted(p["target"] for p in posted) == ["h:2", "h:3"]
        posted.clear()
        scaler._busy.add("decode")  # a change in progress: leave the router as it is
        await scaler._reregister()
        assert posted == []
    finally:
        await observer.close()
