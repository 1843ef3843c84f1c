"""`pdserve drain`: takes one worker out of every router before it stops, and waits for the
requests it still runs there. A Kubernetes worker pod runs it as its preStop hook
(deploy/kubernetes), so a pod going away (scale-in, rollout, node drain) loses no request:

    pdserve drain --router dns:pdserve-router-admin:8000 --role decode --target 10.1.2.3:50061

`--router` is http://host:port, or dns:NAME:PORT for every address NAME resolves to (a headless
Service over the routers: each router keeps its own pool, so each one is told); repeatable.
Each router gets POST /admin/workers/drain, then GET /admin/workers until the worker has nothing
in flight there or is gone. The admin key is the one the autoscaler sends ($PDSERVE_ADMIN_API_KEY
or its _FILE, else the first API key).

Exit 0: every router reached has drained the worker (a router that does not know it has nothing
to wait for). Exit 1: the timeout passed with requests still in flight (the router moves decode
streams elsewhere once the worker stops), or no router answered.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from services.router.http.api_keys import first_api_key

DNS_PREFIX = "dns:"
POLL_S = 0.5


@dataclass(frozen=True)
class DrainResult:
    drained: tuple[str, ...]  # routers that drained the worker (or never knew it)
    busy: tuple[str, ...]  # routers still running requests on it at the timeout
    unreachable: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.busy and bool(self.drained)


def router_urls(specs: list[str]) -> list[str]:
    """The routers' base URLs: each http(s):// spec as is, each dns:NAME:PORT as one URL per
    address NAME resolves to now (none when it does not resolve)."""
    urls: list[str] = []
    for spec in specs:
        if not spec.startswith(DNS_PREFIX):
            urls.append(spec.rstrip("/"))
            continue
        host, _, port = spec.removeprefix(DNS_PREFIX).rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            print(f"pdserve drain: {spec} does not resolve: {e}", file=sys.stderr, flush=True)
            continue
        for ip in sorted({str(info[4][0]) for info in infos}):
            urls.append(f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}")
    return list(dict.fromkeys(urls))


def _inflight(http: httpx.Client, url: str, role: str, target: str) -> int:
    """Requests in flight on the worker at that router (0 once the router forgot it)."""
    r = http.get(f"{url}/admin/workers")
    r.raise_for_status()
    return sum(int(w["inflight"]) for w in r.json()["workers"]
               if w["role"] == role and w["target"] == target)


def drain(routers: list[str], role: str, target: str, timeout_s: float,
          api_key: str | None = None, request_timeout_s: float = 5.0) -> DrainResult:
    """Drains `target` (a `role` worker) in every router of `routers` (specs as `--router`) and
    waits until none has a request in flight there, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    drained: list[str] = []
    waiting: list[str] = []
    unreachable: list[str] = []
    with httpx.Client(headers=headers, timeout=request_timeout_s) as http:
        for url in router_urls(routers):
            try:
                r = http.post(f"{url}/admin/workers/drain", json={"role": role, "target": target})
            except httpx.HTTPError as e:
                print(f"pdserve drain: {url} did not answer: {e}", file=sys.stderr, flush=True)
                unreachable.append(url)
                continue
            if r.status_code == 404:  # it does not know the worker (never did, or removed it)
                drained.append(url)
            elif r.status_code == 200:
                waiting.append(url)
            else:
                print(f"pdserve drain: {url} refused: {r.status_code} {r.text[:200]}",
                      file=sys.stderr, flush=True)
                unreachable.append(url)
        while waiting:
            for url in list(waiting):
                try:
                    if _inflight(http, url, role, target) == 0:
                        waiting.remove(url)
                        drained.append(url)
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    print(f"pdserve drain: {url}: {e}", file=sys.stderr, flush=True)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    return DrainResult(tuple(drained), tuple(waiting), tuple(unreachable))


def add_drain_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("drain", help="take a worker out of every router and wait for its requests")
    p.add_argument("--router", action="append", required=True, metavar="URL|dns:NAME:PORT",
                   help="a router (http://host:port) or every address of a name (repeatable)")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the worker, as the router names it")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="longest wait for the requests in flight there")
    p.set_defaults(func=run_drain)


def run_drain(args: argparse.Namespace) -> int:
    result = drain(args.router, args.role, args.target, args.timeout_s, first_api_key())
    if result.busy:
        print(f"pdserve drain: {args.target} still has requests in flight at {', '.join(result.busy)} "
              f"after {args.timeout_s:g} s", file=sys.stderr, flush=True)
    elif not result.drained:
        print(f"pdserve drain: no router answered for {args.target}", file=sys.stderr, flush=True)
    else:
        print(f"pdserve drain: {args.target} drained at {len(result.drained)} router(s)", flush=True)
    return 0 if result.ok else 1
