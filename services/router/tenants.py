"""API keys and tenants: the router's key check, and each request's effective cache salt.

Any configured key (services/router/api_keys.py) is accepted on `/v1/*`, `/admin/*`, `/tokenize`
and `/detokenize`, each compared in constant time.

With `--tenant-cache-salt` each key is its own tenant: its salt is a hash of the key under a
domain-separation string (the key itself never leaves the router), and the effective salt of a
request combines it with the request's own `cache_salt`, so no tenant can choose a salt that
equals another tenant's. KV (prefix caches, the KV store) is shared only within one effective
salt. Without the flag the effective salt is the request's `cache_salt` alone.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.errors import OpenAIError

# The API docs too: the schema tells an attacker every field and endpoint.
PROTECTED_PREFIXES = ("/v1", "/admin", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")
_TENANT_DOMAIN = b"pdserve.router.tenant-cache-salt.v1\0"
_COMBINED_DOMAIN = b"pdserve.router.tenant-request-salt.v1\0"

# The tenant salt of the request being handled (set by ApiKeyAuth), None without tenants.
_tenant_salt: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant_salt", default=None)


def tenant_salt(api_key: str) -> str:
    """The cache salt of the tenant holding `api_key` (hex SHA-256 under a domain string)."""
    return hashlib.sha256(_TENANT_DOMAIN + api_key.encode()).hexdigest()


def effective_salt(tenant: str | None, request_salt: str | None) -> str:
    """The salt a request's KV is shared under ("" = none): the tenant's, combined with the
    request's own when it sent one; the request's own alone without tenants."""
    if tenant is None:
        return request_salt or ""
    if request_salt is None:
        return tenant
    return hashlib.sha256(_COMBINED_DOMAIN + tenant.encode() + b"\0" + request_salt.encode()).hexdigest()


def request_salt(request_salt: str | None) -> str:
    """`effective_salt` of the request being handled (its tenant from the API key it used)."""
    return effective_salt(_tenant_salt.get(), request_salt)


class ApiKeyAuth:
    """Pure ASGI middleware: a protected path needs `Authorization: Bearer <key>` with one of
    `keys` (else 401). With `tenants`, the request's tenant salt is set for its handlers."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], tenants: bool = False) -> None:
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.app = app
        self._expected = [(f"Bearer {k}".encode(), tenant_salt(k) if tenants else None) for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        given = next((v for n, v in scope["headers"] if n == b"authorization"), b"")
        found = False
        salt = None
        for expected, tenant in self._expected:  # every key compared: no early exit to time
            if hmac.compare_digest(given, expected):
                found, salt = True, tenant
        if not found:
            await OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key").response()(scope, receive, send)
            return
        token = _tenant_salt.set(salt)
        try:
            await self.app(scope, receive, send)
        finally:
            _tenant_salt.reset(token)
