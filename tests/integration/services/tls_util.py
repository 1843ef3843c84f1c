"""Test certificates made with the `openssl` CLI: a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate (mutual TLS), all signed by that CA, valid one day."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _sign(name: str, subject: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


def make_certs(folder: Path) -> Certs:
    """Writes the CA and both certificates into `folder`; skips the test without `openssl`."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed: TLS tests need it to make certificates")
    _openssl("req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=pdserve test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    _sign("server", "/CN=localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n", folder)
    _sign("client", "/CN=pdserve router", "extendedKeyUsage=clientAuth\n", folder)
    return Certs(*(str(folder / f) for f in ("ca.pem", "server.pem", "server.key", "client.pem",
                                               "client.key")))
