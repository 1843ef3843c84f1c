"""API keys and tenants: the router's key check, and each request's effective cache salt.

Any configured key (services/router/http/api_keys.py) is accepted on `/v1/*`, `/tokenize`,
`/detokenize` and the API docs, each compared in constant time. The admin API (`/admin/*`, which
adds and drains workers: whoever holds it decides where prompts go) takes an admin key
(`$PDSERVE_ADMIN_API_KEY`) when one is configured; without one, any API key when the keys are
one operator's, none at all when they are tenants (`--tenant-cache-salt`), and with no key of
either kind configured, callers on loopback only.

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
# Which configured key the request being handled presented (its index), None without one.
_caller_key: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller_key", default=None)


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


def caller(scope: Scope) -> str:
    """Who sent the request being handled, for per-client limits: the API key it presented
    (by its position among the configured keys, never the key), else its address."""
    key = _caller_key.get()
    if key is not None:
        return f"key {key}"
    client = scope.get("client")
    return f"address {client[0]}" if client else "address unknown"


def current_tenant() -> str:
    """The tenant of the request being handled ("" without tenants: the operator's one)."""
    return _tenant_salt.get() or ""


def request_salt(request_salt: str | None) -> str:
    """`effective_salt` of the request being handled (its tenant from the API key it used)."""
    return effective_salt(_tenant_salt.get(), request_salt)


class ApiKeyAuth:
    """Pure ASGI middleware: a protected path needs `Authorization: Bearer <key>` with one of
    `keys` or `admin_keys` (else 401); `/admin/*` as the module docstring says (else 401 / 403).
    With `tenants`, the request's tenant salt is set for its handlers."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], tenants: bool = False,
                 admin_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self._expected = [(f"Bearer {k}".encode(), tenant_salt(k) if tenants else None, k in admin_keys)
                          for k in dict.fromkeys(keys + admin_keys)]
        self._admin_needs_admin_key = bool(admin_keys) or tenants
        self._api_open = not keys  # no API keys: /v1/* etc. take anyone
        self._open = not keys and not admin_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        admin = path.startswith("/admin")
        if not path.startswith(PROTECTED_PREFIXES) or (self._api_open and not admin):
            await self.app(scope, receive, send)
            return
        if self._open:  # no keys at all: the admin API answers this host only
            if not _from_loopback(scope):
                await _deny(403, "the admin API takes calls from this host only unless "
                                 "PDSERVE_ADMIN_API_KEY (or an API key) is configured")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        given = next((v for n, v in scope["headers"] if n == b"authorization"), b"")
        found, salt, is_admin, index = False, None, False, None
        for i, (expected, tenant, admin_key) in enumerate(self._expected):  # all compared: no early exit
            if hmac.compare_digest(given, expected):
                found, salt, is_admin, index = True, tenant, admin_key, i
        if not found:
            await _deny(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")(
                scope, receive, send)
            return
        if admin and self._admin_needs_admin_key and not is_admin:
            await _deny(403, "the admin API needs an admin key ($PDSERVE_ADMIN_API_KEY); API keys "
                             "of tenants are not admins")(scope, receive, send)
            return
        token, key_token = _tenant_salt.set(salt), _caller_key.set(index)
        try:
            await self.app(scope, receive, send)
        finally:
            _tenant_salt.reset(token)
            _caller_key.reset(key_token)


def _deny(status: int, message: str) -> ASGIApp:
    code = "invalid_api_key" if status == 401 else "permission_denied"
    app: ASGIApp = OpenAIError(status, message, code=code).response()
    return app


def _from_loopback(scope: Scope) -> bool:
    from kvstore.credentials import is_loopback

    client = scope.get("client")
    return client is not None and is_loopback(str(client[0]))
