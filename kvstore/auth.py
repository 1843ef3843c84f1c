"""Who may do what on the KV store: bearer tokens with roles (kvstore/credentials.py reads the
token file), checked by a Flight server middleware at the start of every call, then per
operation before anything is read or stored.

    DoPut, shm_put, lease, pin                 producer
    DoGet, shm_get, lookup, exists, release,   consumer
      unpin
    delete, stats, metrics                     admin
    health, shm_info, list_actions             any valid token

A call without a token, or with one the file does not hold, is refused at its start with
UNAUTHENTICATED (flight.FlightUnauthenticatedError); a valid token without the role the
operation needs gets PERMISSION_DENIED (flight.FlightUnauthorizedError). Messages name the
operation and the role, never the token.
"""

from __future__ import annotations

import hmac
from typing import Any

import pyarrow.flight as flight

MIDDLEWARE_KEY = "pdserve-auth"

# The role each operation needs; None = any caller with a valid token.
PERMISSIONS: dict[str, str | None] = {
    "put": "producer", "shm_put": "producer", "lease": "producer", "pin": "producer",
    "get": "consumer", "shm_get": "consumer", "lookup": "consumer", "exists": "consumer",
    "release": "consumer", "unpin": "consumer",
    "delete": "admin", "stats": "admin", "metrics": "admin",
    "health": None, "shm_info": None, "list_actions": None,
}


class CallerRoles(flight.ServerMiddleware):
    """The roles of the token that authenticated this call."""

    def __init__(self, roles: frozenset[str]) -> None:
        self.roles = roles


class TokenAuthFactory(flight.ServerMiddlewareFactory):
    """Checks `authorization: Bearer <token>` on every call against `tokens` (token -> roles),
    comparing with every known token in constant time."""

    def __init__(self, tokens: dict[str, frozenset[str]]) -> None:
        if not tokens:
            raise ValueError("token auth needs at least one token")
        self._tokens = [(token.encode(), roles) for token, roles in tokens.items()]

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> CallerRoles:
        presented = _bearer(headers.get("authorization", []))
        if presented is None:
            raise flight.FlightUnauthenticatedError(
                "the KV store needs 'authorization: Bearer <token>' (set PDSERVE_KV_TOKEN or "
                "PDSERVE_KV_TOKEN_FILE)")
        found: frozenset[str] | None = None
        for token, roles in self._tokens:  # no early exit: the time does not tell which matched
            if hmac.compare_digest(token, presented):
                found = roles
        if found is None:
            raise flight.FlightUnauthenticatedError("the KV store does not know this token")
        return CallerRoles(found)


def _bearer(values: list[Any]) -> bytes | None:
    for value in values:
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode("latin-1", errors="replace")
    return None


def check_role(context: Any, op: str, enabled: bool) -> None:
    """Raises FlightUnauthorizedError unless the caller of `context` holds the role `op` needs
    (a no-op when the server runs without tokens)."""
    if not enabled:
        return
    middleware = context.get_middleware(MIDDLEWARE_KEY)
    if middleware is None:  # the factory raises for every unauthenticated call; defensive
        raise flight.FlightUnauthenticatedError(f"{op}: not authenticated")
    needed = PERMISSIONS.get(op, "admin")  # an operation missing from the table: admin only
    if needed is not None and needed not in middleware.roles:
        raise flight.FlightUnauthorizedError(
            f"{op}: needs the {needed!r} role; this token has "
            f"{', '.join(sorted(middleware.roles)) or 'no roles'}")
