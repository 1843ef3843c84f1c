"""The router's admin API: the workers it knows, and workers joining and leaving by draining (the
autoscaler's actuators and operators use it).

    GET  /admin/workers            every worker, by pool, with its health and load
    POST /admin/workers            {"role", "target"}: register (idempotent); the target must be
                                   host:port (a hostname or IP, [v6] bracketed) whose every address
                                   lies in the router's worker networks (--worker-networks: private
                                   ones by default; loopback, link-local such as a cloud's metadata
                                   service at 169.254.169.254, and public addresses only when listed)
                                   and that accepts a TCP connection within 2 s, else 400 naming
                                   `target`. (A name is checked as it resolves now: list addresses,
                                   not names, where DNS is not trusted.)
    POST /admin/workers/drain      {"role", "target"}: no new requests
    POST /admin/workers/remove     {"role", "target", "force"}: forget a drained worker
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.router.api.openai_models import WorkerChange
from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.pool import WorkerPool
from services.router.errors import OpenAIError

CONNECT_TIMEOUT_S = 2.0
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"  # RFC 1123, and '_' as compose names have
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")


def parse_target(target: str) -> tuple[str, int]:
    """(host, port) of a worker target `host:port` (host a hostname or an IP literal, an IPv6 one
    in brackets; port 1..65535); raises OpenAIError 400 naming `target` otherwise."""
    def bad(why: str) -> OpenAIError:
        return OpenAIError(400, f"target: {why}, got {target!r}; expected host:port", "target")

    host, sep, port = target.rpartition(":")
    if not sep or not host:
        raise bad("no port")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise bad("the port must be an integer in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad("not an IPv6 address in the brackets") from None
        return host[1:-1], int(port)
    if not _HOSTNAME.match(host):
        raise bad("the host must be a hostname or an IP address (no scheme, no path)")
    return host, int(port)


Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def parse_networks(specs: tuple[str, ...]) -> Networks:
    """CIDR strings ("10.0.0.0/8", "::1/128") -> networks; ValueError naming a bad one."""
    out = []
    for spec in specs:
        try:
            out.append(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError as e:
            raise ValueError(f"worker_networks: {spec!r} is not a network (CIDR): {e}") from None
    return tuple(out)


async def check_target(target: str, networks: Networks) -> None:
    """Raises OpenAIError 400 naming `target` unless it is well formed, every address it resolves
    to lies in `networks`, and it accepts a TCP connection within CONNECT_TIMEOUT_S (resolution
    and connect on the event loop, not blocking it; the connection goes to a checked address)."""
    host, port = parse_target(target)
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):
        raise OpenAIError(400, f"target: {host} does not resolve", "target") from None
    addresses = sorted({str(info[4][0]) for info in infos})
    outside = [a for a in addresses if not _inside(a, networks)]
    if outside or not addresses:
        listed = ", ".join(str(n) for n in networks) or "none"
        raise OpenAIError(400, f"target: {', '.join(outside) or host} is not in the router's worker "
                               f"networks ({listed}; the router's --worker-networks)", "target")
    await check_reachable(target, addresses[0], port)


def _inside(address: str, networks: Networks) -> bool:
    """Whether `address` lies in one of `networks` (an IPv4-mapped IPv6 address as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in n for n in networks)


async def check_reachable(target: str, address: str, port: int) -> None:
    """Raises OpenAIError 400 naming `target` unless `address:port` accepts a TCP connection
    within CONNECT_TIMEOUT_S."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):  # one message whatever the cause: no network probing
        raise OpenAIError(400, f"target: {target} did not accept a TCP connection within "
                               f"{CONNECT_TIMEOUT_S:g} s", "target") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def admin_router(dispatcher: Callable[[], Dispatcher], networks: Networks) -> APIRouter:
    """The admin routes over the dispatcher `dispatcher()` returns (it lives in the app's loop);
    workers may join from `networks` only."""
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
        pool = pool_of(body.role)
        if pool.find(body.target) is None:
            await check_target(body.target, networks)
        w = pool.add(body.target)
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
