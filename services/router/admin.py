"""The router's admin API: the workers it knows, and workers joining and leaving by draining (the
autoscaler's actuators and operators use it).

    GET  /admin/workers            every worker, by pool, with its health and load
    POST /admin/workers            {"role", "target"}: register (idempotent)
    POST /admin/workers/drain      {"role", "target"}: no new requests
    POST /admin/workers/remove     {"role", "target", "force"}: forget a drained worker
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.router.dispatch import Dispatcher
from services.router.errors import OpenAIError
from services.router.openai_models import WorkerChange
from services.router.pool import WorkerPool


def admin_router(dispatcher: Callable[[], Dispatcher]) -> APIRouter:
    """The admin routes over the dispatcher `dispatcher()` returns (it lives in the app's loop)."""
    router = APIRouter(prefix="/admin")

    def pool_of(role: str) -> WorkerPool:
        pools = {p.role: p for p in dispatcher().pools}
        if role not in pools:
            raise OpenAIError(400, f"role must be one of {sorted(pools)}, got {role!r}", "role")
        return pools[role]

    @router.get("/workers")
    async def list_workers() -> dict[str, Any]:
        """Every worker the router knows, by pool (for the autoscaler and operators)."""
        return {"workers": [{"role": p.role, "target": w.target, "healthy": w.healthy,
                             "draining": w.draining, "inflight": w.inflight, "dispatched": w.requests,
                             "last_error": w.last_error, "instance_id": w.instance,
                             "waiting": w.load.num_waiting if w.load else 0,
                             "running": w.load.num_running if w.load else 0,
                             "kv_usage": w.load.kv_usage if w.load else 0.0,
                             "prompt_tokens": w.load.num_prompt_tokens if w.load else 0,
                             "busy_seconds": w.load.busy_seconds if w.load else 0.0}
                            for p in dispatcher().pools for w in p.workers]}

    @router.post("/workers")
    async def add_worker(body: WorkerChange) -> dict[str, Any]:
        """Registers a worker (idempotent); it gets requests once its first load report is in."""
        w = pool_of(body.role).add(body.target)
        return {"target": w.target, "role": body.role, "healthy": w.healthy}

    @router.post("/workers/drain")
    async def drain_worker(body: WorkerChange) -> dict[str, Any]:
        """No new requests for the worker; `inflight` says how many are still running there."""
        w = pool_of(body.role).drain(body.target)
        if w is None:
            raise OpenAIError(404, f"no {body.role} worker {body.target}", "target")
        return {"target": w.target, "draining": True, "inflight": w.inflight}

    @router.post("/workers/remove")
    async def remove_worker(body: WorkerChange) -> JSONResponse:
        """Forgets a worker: 409 while it still has requests in flight, unless `force`."""
        pool = pool_of(body.role)
        w = pool.find(body.target)
        if w is not None and not w.draining and not body.force:
            raise OpenAIError(409, f"drain {body.target} before removing it", "target")
        if not await pool.remove(body.target, force=body.force):
            raise OpenAIError(409, f"{body.target} still has {w.inflight if w else 0} requests in "
                                   f"flight", "target")
        return JSONResponse({"target": body.target, "removed": True})

    return router
