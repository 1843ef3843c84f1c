"""Health and process routes: `/health` (readiness), `/ping` (vLLM's, = /health), `/livez`
(liveness, on the loop; the off-loop one is http/liveness.py), `/version` and `/metrics`."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from services.router.api.openai_models import HEALTH_RESPONSES
from services.router.generation import Generator


def health_router(gen: Callable[[], Generator], instance_id: str, version: str) -> APIRouter:
    router = APIRouter()

    @router.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        """Readiness: 200 while at least one decode (or colocated) worker is healthy, else 503."""
        dispatcher = gen().dispatcher
        pools = {p.role: {"healthy": len(p.healthy), "workers": len(p.workers)} for p in dispatcher.pools}
        ok = bool(dispatcher.decode.healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", "pools": pools,
                             "instance_id": instance_id}, status_code=200 if ok else 503)

    @router.get("/ping", responses=HEALTH_RESPONSES)
    async def ping() -> JSONResponse:
        """vLLM's /ping (SageMaker's probe): /health's status."""
        return await health()

    @router.post("/ping", responses=HEALTH_RESPONSES)
    async def ping_post() -> JSONResponse:
        return await health()

    @router.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version}

    @router.get("/livez")
    async def livez() -> dict[str, str]:
        """Liveness, as the event loop answers it (restarting a router whose workers are down
        would not help: that is /health's 503). The liveness port answers off the loop."""
        return {"status": "alive", "instance_id": instance_id}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(gen().metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router
