"""The worker plane's credentials without a worker: what clients send, the protected-mode rule,
the router's worker TLS flags, and the admin API's target syntax."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.credentials import TLSFiles
from services.cli import build_parser
from services.router.errors import OpenAIError
from services.router.http.admin import parse_target
from services.worker.auth import ExposedWorkerError, WorkerAccess, check_exposure


def test_worker_access_reads_the_token_file_and_never_shows_the_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "token"
    secret.write_text("t0ken-from-file\n")
    monkeypatch.delenv("PDSERVE_WORKER_TOKEN", raising=False)
    monkeypatch.setenv("PDSERVE_WORKER_TOKEN_FILE", str(secret))
    monkeypatch.setenv("PDSERVE_WORKER_TLS_CA", "/ca.pem")
    access = WorkerAccess.from_env()
    assert access.metadata == (("authorization", "Bearer t0ken-from-file"),)
    assert access.tls == TLSFiles(ca="/ca.pem")
    assert "t0ken" not in repr(access)
    assert WorkerAccess().metadata == () and WorkerAccess().channel_credentials() is None


@pytest.mark.parametrize(("host", "token", "tls", "no_auth", "refused"), [
    ("0.0.0.0", None, TLSFiles(), False, True),
    ("10.1.2.3", None, TLSFiles("c", "k"), False, True),  # TLS without client certificates: anyone
    ("0.0.0.0", "t", TLSFiles(), False, False),
    ("0.0.0.0", None, TLSFiles("c", "k", "ca"), False, False),  # mutual TLS authenticates
    ("0.0.0.0", None, TLSFiles(), True, False),
    ("127.0.0.1", None, TLSFiles(), False, False),
    ("[::1]", None, TLSFiles(), False, False),
    ("localhost", None, TLSFiles(), False, False),
])
def test_a_worker_without_credentials_listens_beyond_loopback_only_with_no_auth(
        host: str, token: str | None, tls: TLSFiles, no_auth: bool, refused: bool) -> None:
    if refused:
        with pytest.raises(ExposedWorkerError, match=f"refusing to listen on {host}"):
            check_exposure(host, token, tls, no_auth)
    else:
        check_exposure(host, token, tls, no_auth)


def test_router_worker_tls_flags_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_WORKER_TLS_CA", "/env/ca.pem")
    args = build_parser().parse_args(["router", "--decode", "127.0.0.1:1", "--worker-tls-cert", "/c.pem",
                                      "--worker-tls-key", "/k.pem", "--disable-docs"])
    tls = (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    assert tls == ("/env/ca.pem", "/c.pem", "/k.pem")
    assert args.disable_docs


@pytest.mark.parametrize(("target", "expected"), [
    ("127.0.0.1:50061", ("127.0.0.1", 50061)),
    ("decode-1.pdserve.svc.cluster.local:1", ("decode-1.pdserve.svc.cluster.local", 1)),
    ("pdserve_decode_1:65535", ("pdserve_decode_1", 65535)),  # compose names have underscores
    ("[::1]:80", ("::1", 80)),
])
def test_admin_targets_are_host_and_port(target: str, expected: tuple[str, int]) -> None:
    assert parse_target(target) == expected


@pytest.mark.parametrize("target", ["127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", ":80", "http://x:1",
                                    "x/y:1", "a b:1", "::1:80", "[::g]:80", "[::1]", "-x:1", "x:+1",
                                    "x:١", "a..b:1", "x" * 64 + ":1"])
def test_admin_refuses_malformed_targets_naming_target(target: str) -> None:
    with pytest.raises(OpenAIError) as err:
        parse_target(target)
    assert err.value.status == 400 and err.value.param == "target"
