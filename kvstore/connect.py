"""How a client reaches the KV store: the location's scheme, TLS roots and client certificate,
and the bearer token sent on every call (kvstore/auth.py checks it).

Defaults come from the environment, never argv: the token from `PDSERVE_KV_TOKEN` /
`PDSERVE_KV_TOKEN_FILE`, TLS files from `PDSERVE_KV_TLS_CA` (roots that verify the server),
`PDSERVE_KV_TLS_CERT` / `PDSERVE_KV_TLS_KEY` (this client's certificate, for mutual TLS).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pyarrow.flight as flight

from kvstore.credentials import TLSFiles, read_secret

logger = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_KV_TOKEN"
TLS_ENV_PREFIX = "PDSERVE_KV_TLS"


@dataclass(frozen=True)
class StoreCredentials:
    """The token (None = send none) and TLS files of a store client."""

    token: str | None = field(default=None, repr=False)
    tls: TLSFiles = field(default_factory=TLSFiles)

    @classmethod
    def resolve(cls, token: str | None = None, tls_ca: str | None = None,
                tls_cert: str | None = None, tls_key: str | None = None) -> StoreCredentials:
        """Each argument given wins over its environment default."""
        env = TLSFiles.from_env(TLS_ENV_PREFIX)
        tls = TLSFiles(cert=tls_cert or env.cert, key=tls_key or env.key, ca=tls_ca or env.ca)
        for path in (tls.ca, tls.cert, tls.key):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"KV store client: TLS file {path} does not exist")
        return cls(token=token if token is not None else read_secret(TOKEN_ENV), tls=tls)

    def location(self, location: str) -> str:
        """`location` with a scheme: a bare host:port is grpc+tls:// when TLS files are set,
        else grpc://."""
        if "://" in location:
            if location.startswith("grpc://") and self.tls.enabled:
                logger.warning("KV store location %s is plaintext grpc:// although TLS files are "
                               "set (%s_*): use grpc+tls:// to encrypt", location, TLS_ENV_PREFIX)
            return location
        return f"{'grpc+tls' if self.tls.enabled else 'grpc'}://{location}"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + self.token.encode())] if self.token else []

    def connect(self, location: str, generic_options: list[tuple[str, int]],
                server_name: str | None = None) -> flight.FlightClient:
        """A Flight client of `location` (with this client's TLS roots and certificate when
        the location is grpc+tls://; `server_name` is the name the server's certificate must
        hold when the location is an address found by DNS)."""
        kwargs: dict[str, Any] = {}
        if location.startswith("grpc+tls://"):
            if server_name is not None:
                kwargs["override_hostname"] = server_name
            if self.tls.ca is not None:
                kwargs["tls_root_certs"] = _read(self.tls.ca)
            if self.tls.cert is not None and self.tls.key is not None:
                kwargs["cert_chain"] = _read(self.tls.cert)
                kwargs["private_key"] = _read(self.tls.key)
        return flight.FlightClient(location, generic_options=generic_options, **kwargs)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
