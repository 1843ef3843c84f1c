"""API keys from the environment, a key file and argv; tenant salts and effective salts; the
router's prefix-index hashes include the salt."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest

from services.router.config import RouterConfig
from services.router.dispatch.prefix_index import block_hashes
from services.router.http.api_keys import first_api_key, load_api_keys
from services.router.http.tenants import effective_salt, tenant_salt


def test_keys_come_from_the_variable_the_file_and_argv_in_that_order(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text("# tenants\nkey-b\n\n  key-c  # the second tenant\nkey-a\n")
    env = {"PDSERVE_API_KEY": "key-a, key-x,"}
    assert load_api_keys(None, str(path), env) == ("key-a", "key-x", "key-b", "key-c")
    assert load_api_keys(None, None, {"PDSERVE_API_KEY_FILE": str(path)}) == ("key-b", "key-c", "key-a")
    with caplog.at_level(logging.WARNING):
        assert load_api_keys("key-z", None, {}) == ("key-z",)
    assert "visible to other users" in caplog.text
    assert load_api_keys(None, None, {}) == ()
    assert first_api_key(None, str(path), env) == "key-a"
    assert first_api_key(None, None, {}) is None
    assert first_api_key(None, str(path), {**env, "PDSERVE_ADMIN_API_KEY": "root"}) == "root"


def test_a_tenant_salt_is_a_domain_separated_hash_never_the_key() -> None:
    salt = tenant_salt("s3cret")
    assert salt == hashlib.sha256(b"pdserve.router.tenant-cache-salt.v1\0s3cret").hexdigest()
    assert "s3cret" not in salt and salt != tenant_salt("s3cret2")


def test_no_request_salt_can_give_another_tenant_s_effective_salt() -> None:
    a, b = tenant_salt("key-a"), tenant_salt("key-b")
    assert effective_salt(None, None) == "" and effective_salt(None, "x") == "x"
    assert effective_salt(a, None) == a
    # Tenant b naming tenant a's salt (or a's combined one) still gets a salt of its own.
    reachable_by_b = {effective_salt(b, s) for s in (None, a, effective_salt(a, "x"), "x")}
    assert not reachable_by_b & {a, effective_salt(a, "x"), effective_salt(a, a)}


def test_router_config_needs_keys_for_tenants() -> None:
    with pytest.raises(ValueError, match="tenant_cache_salt"):
        RouterConfig(model="m", tokenizer="m", tenant_cache_salt=True)
    with pytest.raises(ValueError, match="api_keys"):
        RouterConfig(model="m", tokenizer="m", api_keys=("",))
    RouterConfig(model="m", tokenizer="m", api_keys=("a", "b"), tenant_cache_salt=True)


def test_prefix_index_hashes_of_a_salted_prompt_share_nothing_with_other_salts() -> None:
    tokens = list(range(48))
    plain, s1, s2 = (block_hashes(tokens, 16, s) for s in ("", "s1", "s2"))
    assert len({*plain, *s1, *s2}) == 9
    assert block_hashes(tokens, 16, "s1") == s1


async def _status(app: Any, path: str, key: str | None = None, client: str = "127.0.0.1") -> int:
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app, client=(client, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
        return (await http.get(path, headers=headers)).status_code


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_admin_api_is_never_a_tenant_key() -> None:
    """/admin decides where prompts go: tenants' keys never open it, an admin key does; with no
    key of any kind configured it answers loopback callers only."""
    from services.router.http.tenants import ApiKeyAuth

    open_app = ApiKeyAuth(_ok, keys=())
    assert await _status(open_app, "/v1/models", client="10.0.0.5") == 200
    assert await _status(open_app, "/admin/workers") == 200
    assert await _status(open_app, "/admin/workers", client="10.0.0.5") == 403
    one_operator = ApiKeyAuth(_ok, keys=("k1",))
    assert await _status(one_operator, "/admin/workers", "k1", client="10.0.0.5") == 200
    assert await _status(one_operator, "/admin/workers") == 401
    tenants = ApiKeyAuth(_ok, keys=("alice", "bob"), tenants=True)
    assert await _status(tenants, "/v1/models", "alice") == 200
    assert await _status(tenants, "/admin/workers", "alice") == 403
    with_admin = ApiKeyAuth(_ok, keys=("alice", "bob"), tenants=True, admin_keys=("root",))
    assert await _status(with_admin, "/admin/workers", "root", client="10.0.0.5") == 200
    assert await _status(with_admin, "/admin/workers", "bob") == 403
    assert await _status(with_admin, "/v1/models", "root") == 200
    assert await _status(with_admin, "/v1/models", "eve") == 401
    admin_only = ApiKeyAuth(_ok, keys=(), admin_keys=("root",))
    assert await _status(admin_only, "/v1/models") == 200
    assert await _status(admin_only, "/admin/workers") == 401
