"""The KV store's access control over real Arrow Flight on loopback: bearer tokens with roles
(kvstore/auth.py), protected mode, TLS and mutual TLS. Every refused call is refused with the
right gRPC status before anything is stored; an admin's stats show the store still empty."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.flight as flight
import pytest

from kvstore.client import KVStoreAuthError, KVStoreClient, KVStoreClientError
from kvstore.credentials import TLSFiles, is_loopback, parse_token_file, read_secret
from kvstore.lmcache_format import CacheEngineKey, MemoryFormat, RemoteMetadata
from kvstore.service import KVStoreService, StoreOptions

ROOT = Path(__file__).resolve().parents[3]
CHUNK = CacheEngineKey("m", 1, 0, 0xABC, "float32")
TOKENS = {"p-tok": "producer", "c-tok": "consumer", "a-tok": "admin",
          "pc-tok": "producer,consumer"}
UNAUTHENTICATED = "does not know this token"


def item(i: int, size: int = 64) -> tuple[str, bytes, bytes]:
    meta = RemoteMetadata.single((1, 1, size // 4), "float32", MemoryFormat.KV_T2D).pack()
    return CHUNK.layer(i).to_string(), meta, bytes(size)


@pytest.fixture(autouse=True)
def no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDSERVE_KV_TOKEN", "PDSERVE_KV_TOKEN_FILE", "PDSERVE_KV_TLS_CA",
                 "PDSERVE_KV_TLS_CERT", "PDSERVE_KV_TLS_KEY", "PDSERVE_KV_AUTH_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def auth_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("# pdserve kvstore tokens\n\n"
                    + "".join(f"{t} {r}  # {r}\n" for t, r in TOKENS.items()))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def store(auth_file: Path) -> Iterator[KVStoreService]:
    opts = StoreOptions(capacity="16MiB", port=0, auth_file=str(auth_file))
    with KVStoreService(opts) as service:
        yield service


def client(store: KVStoreService, token: str | None, use_shm: bool = False,
           **kw: Any) -> KVStoreClient:
    return KVStoreClient(store.location, timeout_s=10, use_shm=use_shm, token=token or "", **kw)


@pytest.fixture
def admin(store: KVStoreService) -> Iterator[KVStoreClient]:
    with client(store, "a-tok") as c:
        c.delete([item(i)[0] for i in range(4)])
        yield c


# --- credentials module -------------------------------------------------------------------

def test_secrets_come_from_the_variable_or_its_file(tmp_path, monkeypatch) -> None:
    assert read_secret("PDSERVE_KV_TOKEN") is None
    (tmp_path / "t").write_text("from-file\n")
    monkeypatch.setenv("PDSERVE_KV_TOKEN_FILE", str(tmp_path / "t"))
    assert read_secret("PDSERVE_KV_TOKEN") == "from-file"
    monkeypatch.setenv("PDSERVE_KV_TOKEN", "from-env")
    assert read_secret("PDSERVE_KV_TOKEN") == "from-env"


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "10.0.0.1", "example.com"]))


def test_tls_files_from_env(monkeypatch) -> None:
    monkeypatch.setenv("X_CA", "/ca.pem")
    assert TLSFiles.from_env("X") == TLSFiles(ca="/ca.pem")
    monkeypatch.setenv("X_CERT", "/c.pem")
    with pytest.raises(ValueError, match="needs its key"):
        TLSFiles.from_env("X")


@pytest.mark.parametrize(("text", "error"), [
    ("secret-token\n", "line 1: expected"),
    ("ok producer\nsecret-token producer extra\n", "line 2: expected"),
    ("# c\nsecret-token producer,root\n", r"line 2: unknown role\(s\) \['root'\]"),
    ("secret-token producer\nsecret-token consumer\n", "line 2: this token already"),
])
def test_token_file_errors_name_the_line_not_the_token(tmp_path, text, error) -> None:
    (tmp_path / "f").write_text(text)
    with pytest.raises(ValueError, match=error) as info:
        parse_token_file(str(tmp_path / "f"))
    assert "secret-token" not in str(info.value)


def test_token_file_roles_combine(auth_file: Path) -> None:
    tokens = parse_token_file(str(auth_file))
    assert tokens["pc-tok"] == {"producer", "consumer"} and tokens["a-tok"] == {"admin"}


# --- tokens and roles ------------------------------------------------------------------------

@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_no_or_unknown_token_is_unauthenticated(store, admin, token) -> None:
    with client(store, token) as c:
        for call in (lambda: c.put([item(0)]), lambda: c.get([item(0)[0]]), c.health,
                     lambda: c.lookup([item(0)[0]])):
            with pytest.raises(KVStoreAuthError, match="refused this client") as info:
                call()
            assert isinstance(info.value.__cause__, flight.FlightUnauthenticatedError)
    assert admin.stats().objects == 0


def test_unknown_token_message_never_echoes_it(store) -> None:
    with client(store, "wrong-token") as c, pytest.raises(KVStoreAuthError) as info:
        c.health()
    assert UNAUTHENTICATED in str(info.value) and "wrong-token" not in str(info.value)


@pytest.mark.parametrize("use_shm", [False, True])
def test_consumer_cannot_write(store, admin, use_shm) -> None:
    with client(store, "c-tok", use_shm=use_shm) as c:
        assert c.health() == "SERVING"  # any valid token
        with pytest.raises(KVStoreAuthError, match="needs the 'producer' role") as info:
            c.put([item(0)])
        assert "c-tok" not in str(info.value)
        assert isinstance(info.value.__cause__, flight.FlightUnauthorizedError)
        with pytest.raises(KVStoreAuthError, match="lease: needs the 'producer' role"):
            c.lease([item(0)[0]], 10)
        with pytest.raises(KVStoreAuthError, match="pin: needs the 'producer' role"):
            c.pin([item(0)[0]])
    stats = admin.stats()
    assert (stats.objects, stats.leased, stats.pinned) == (0, 0, 0)


def test_shm_put_needs_the_producer_role(store, admin) -> None:
    with client(store, "c-tok", use_shm=True) as c:
        directory = c.shm_dir()
        if directory is None:
            pytest.skip("no shared-memory directory on this machine")
        with pytest.raises(KVStoreAuthError, match="shm_put: needs the 'producer' role"):
            c._shm.put(directory, [item(0)], None)
        assert not [n for n in os.listdir(directory) if n.startswith(("put-", "obj-"))]
    assert admin.stats().objects == 0


@pytest.mark.parametrize("use_shm", [False, True])
def test_producer_writes_and_consumer_reads(store, admin, use_shm) -> None:
    with client(store, "p-tok", use_shm=use_shm) as p, client(store, "c-tok", use_shm=use_shm) as c:
        p.put([item(0), item(1)])
        assert p.pin([item(0)[0]]) == 1 and p.lease([item(1)[0]], 30) == 1
        got = c.get([item(0)[0], item(1)[0]])
        assert [g.metadata for g in got if g] == [item(0)[1], item(1)[1]]
        assert c.lookup([item(0)[0], item(1)[0], item(2)[0]]) == 2
        assert c.exists([item(1)[0]]) == [True]
        assert c.release([item(1)[0]]) == 1 and c.unpin([item(0)[0]]) == 1
        for call, op in ((lambda: p.get([item(0)[0]]), "get"),
                         (lambda: p.lookup([item(0)[0]]), "lookup"),
                         (lambda: p.exists([item(0)[0]]), "exists"),
                         (lambda: p.delete([item(0)[0]]), "delete"),
                         (p.stats, "stats"), (p.metrics_text, "metrics")):
            with pytest.raises(KVStoreAuthError, match=f"{op}: needs the") as info:
                call()
            assert isinstance(info.value.__cause__, flight.FlightUnauthorizedError)
    assert admin.stats().objects == 2  # the producer's delete was refused


def test_combined_roles(store, admin) -> None:
    with client(store, "pc-tok") as pc:
        pc.put([item(3)])
        assert pc.get([item(3)[0]])[0] is not None
        with pytest.raises(KVStoreAuthError, match="stats: needs the 'admin' role"):
            pc.stats()
    assert admin.delete([item(3)[0]]) == 1


def test_every_action_has_a_role_and_a_missing_one_means_admin(store) -> None:
    """The permission table covers every action the server has; an action added without an
    entry is admin-only (fail closed), never open to any token."""
    from kvstore.auth import PERMISSIONS, check_role

    assert set(store.server._actions) <= set(PERMISSIONS)

    class Context:
        def get_middleware(self, key: str) -> Any:
            from kvstore.auth import CallerRoles

            return CallerRoles(frozenset({"producer", "consumer"}))

    with pytest.raises(flight.FlightUnauthorizedError, match="needs the 'admin' role"):
        check_role(Context(), "some_new_action", True)


def test_token_from_the_environment(store, admin, tmp_path, monkeypatch) -> None:
    (tmp_path / "tok").write_text("p-tok\n")
    monkeypatch.setenv("PDSERVE_KV_TOKEN_FILE", str(tmp_path / "tok"))
    with KVStoreClient(store.location, use_shm=False) as p:
        p.put([item(2)])
    assert admin.stats().objects == 1


def test_a_refused_token_does_not_open_the_breaker(store) -> None:
    with KVStoreClient(store.location, token="wrong-token", breaker_s=60, use_shm=False) as c:
        for _ in range(2):
            with pytest.raises(KVStoreAuthError):
                c.health()
        assert c._link.down_until == 0.0


# --- protected mode ---------------------------------------------------------------------------

def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "kvstore", "--port", "0",
                           "--shm-dir", "off", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_non_loopback_host_without_credentials_refuses_to_start() -> None:
    done = run_cli("--host", "0.0.0.0")
    assert done.returncode == 1, done.stderr
    assert "refusing to serve 0.0.0.0 without credentials" in done.stderr
    assert "--no-auth" in done.stderr


def test_bad_token_file_refuses_to_start(tmp_path) -> None:
    (tmp_path / "tokens").write_text("secret-token superuser\n")
    done = run_cli("--auth-file", str(tmp_path / "tokens"))
    assert done.returncode == 1 and "line 1: unknown role" in done.stderr
    assert "secret-token" not in done.stderr
    done = run_cli("--no-auth", env={"PDSERVE_KV_AUTH_FILE": str(tmp_path / "tokens")})
    assert done.returncode == 1 and "contradict" in done.stderr


def test_loopback_without_credentials_runs_open(caplog) -> None:
    with KVStoreService(StoreOptions(port=0, shm_dir="off")) as service, \
            KVStoreClient(service.location, use_shm=False) as c:
        assert c.health() == "SERVING"
    assert "no auth file" in caplog.text


# --- TLS ---------------------------------------------------------------------------------------

def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def signed(d: Path, ca: str, name: str, ext: str) -> tuple[str, str]:
    key, csr, cert, extfile = (d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem",
                               d / f"{name}.ext")
    extfile.write_text(ext)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-subj", f"/CN={name}",
            "-out", csr)
    openssl("x509", "-req", "-in", csr, "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-sha256", "-extfile", extfile, "-out", cert)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, made with
    the openssl CLI; a second CA that signed nothing of ours."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed: TLS certificates cannot be made")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d / f"{ca}.key",
                "-out", d / f"{ca}.pem", "-days", "2", "-subj", f"/CN=pdserve test {ca}")
    server = signed(d, str(d / "ca"), "server",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    client_ = signed(d, str(d / "ca"), "client", "extendedKeyUsage=clientAuth\n")
    return {"ca": str(d / "ca.pem"), "other_ca": str(d / "other-ca.pem"), "server": server[0],
            "server_key": server[1], "client": client_[0], "client_key": client_[1]}


def tls_store(pki: dict[str, str], auth_file: Path, mutual: bool) -> KVStoreService:
    return KVStoreService(StoreOptions(
        port=0, shm_dir="off", auth_file=str(auth_file), tls_cert=pki["server"],
        tls_key=pki["server_key"], tls_client_ca=pki["ca"] if mutual else None))


def test_tls_needs_the_ca_and_still_checks_the_token(pki, auth_file) -> None:
    with tls_store(pki, auth_file, mutual=False) as service:
        assert service.location.startswith("grpc+tls://127.0.0.1:")
        with client(service, "a-tok", tls_ca=pki["other_ca"]) as c, \
                pytest.raises(KVStoreClientError, match="unavailable"):
            c.stats()
        with client(service, "a-tok", tls_ca=pki["ca"]) as c:
            assert c.stats().objects == 0
        with client(service, "c-tok", tls_ca=pki["ca"]) as c, \
                pytest.raises(KVStoreAuthError, match="stats: needs the 'admin' role"):
            c.stats()
        with client(service, "wrong", tls_ca=pki["ca"]) as c, pytest.raises(KVStoreAuthError):
            c.health()


def test_mutual_tls_needs_a_client_certificate(pki, auth_file, monkeypatch) -> None:
    with tls_store(pki, auth_file, mutual=True) as service:
        with client(service, "p-tok", tls_ca=pki["ca"]) as c, \
                pytest.raises(KVStoreClientError, match="unavailable"):
            c.put([item(0)])
        monkeypatch.setenv("PDSERVE_KV_TLS_CA", pki["ca"])
        monkeypatch.setenv("PDSERVE_KV_TLS_CERT", pki["client"])
        monkeypatch.setenv("PDSERVE_KV_TLS_KEY", pki["client_key"])
        bare = service.location.removeprefix("grpc+tls://")  # the scheme follows the TLS files
        with client(service, "p-tok", streams=2, split_put_bytes=32) as p, \
                KVStoreClient(bare, token="c-tok", use_shm=False, parallel_bytes=16) as c:
            p.put([item(0, size=256)])  # in parts over two streams: the pool carries TLS too
            got = c.get([item(0)[0]])[0]
            assert got is not None and got.metadata == item(0, size=256)[1]


# --- shared-memory area ------------------------------------------------------------------------

def test_shared_memory_area_is_private(tmp_path) -> None:
    opts = StoreOptions(port=0, shm_dir=str(tmp_path))
    with KVStoreService(opts) as service, KVStoreClient(service.location) as c:
        directory = c.shm_dir()
        assert directory is not None
        c.put([item(0)])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        files = os.listdir(directory)
        assert any(n.startswith("obj-") for n in files) and ".token" in files
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name


def test_a_dns_location_checks_each_address_against_the_name(pki, auth_file, tmp_path) -> None:
    """`dns:localhost:port` connects to the address localhost resolves to and checks the
    server's certificate for "localhost": a certificate naming only localhost (no IP) passes
    there, and fails for the bare address."""
    cert, key = signed(tmp_path, pki["ca"].removesuffix(".pem"), "name-only",
                       "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n")
    with KVStoreService(StoreOptions(port=0, shm_dir="off", auth_file=str(auth_file),
                                     tls_cert=cert, tls_key=key)) as service:
        port = service.port
        with KVStoreClient(f"dns:localhost:{port}", timeout_s=5, use_shm=False, token="c-tok",
                           tls_ca=pki["ca"]) as c:
            assert c.lookup([item(0)[0]]) == 0
        with KVStoreClient(f"grpc+tls://127.0.0.1:{port}", timeout_s=5, use_shm=False,
                           token="c-tok", tls_ca=pki["ca"]) as c, pytest.raises(KVStoreClientError):
            c.lookup([item(0)[0]])
