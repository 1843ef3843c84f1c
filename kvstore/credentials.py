"""Credentials of pdserve's servers and clients: secrets from the environment (never argv),
the KV store's token file, TLS file sets, and the loopback test of the protected-mode rule.

A secret `NAME` is read from `$NAME` (the value) or `$NAME_FILE` (a path whose stripped content
is the value), so `ps` never shows it and compose / Kubernetes secrets mount as files.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

ROLES = frozenset({"producer", "consumer", "admin"})


def read_secret(name: str) -> str | None:
    """$NAME, else the stripped content of the file $NAME_FILE, else None."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if path:
        with open(path) as f:
            return f.read().strip() or None
    return None


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches only this machine: 127.0.0.0/8, ::1 or localhost.
    An empty host or a wildcard (0.0.0.0, ::) is not: it binds every interface."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one TLS end: `cert` + `key` (its own certificate, e.g. a client's for
    mutual TLS) and `ca` (the roots that verify the other end)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: a certificate needs its key and a key its certificate "
                             f"(cert={self.cert!r}, key={self.key!r})")

    @classmethod
    def from_env(cls, prefix: str) -> TLSFiles:
        """`{prefix}_CA`, `{prefix}_CERT`, `{prefix}_KEY` (paths; unset or empty = None)."""
        def path(suffix: str) -> str | None:
            return os.environ.get(f"{prefix}_{suffix}") or None

        return cls(cert=path("CERT"), key=path("KEY"), ca=path("CA"))

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None


def parse_token_file(path: str) -> dict[str, frozenset[str]]:
    """The token -> roles map of a KV store token file: lines `<token> <role>[,<role>...]`,
    blank lines and `#` comments ignored, roles from ROLES. A malformed line raises ValueError
    naming the file and line number (never the token itself)."""
    tokens: dict[str, frozenset[str]] = {}
    with open(path) as f:
        for number, raw in enumerate(f, start=1):
            fields = raw.split()
            comment = next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))
            fields = fields[:comment]  # a token may hold '#', a comment starts a field with it
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"{path} line {number}: expected '<token> <role>[,<role>...]', got "
                                 f"{len(fields)} field(s)")
            token, role_list = fields
            roles = frozenset(r.strip() for r in role_list.split(","))
            unknown = sorted(roles - ROLES)
            if unknown:
                raise ValueError(f"{path} line {number}: unknown role(s) {unknown}; roles are "
                                 f"{sorted(ROLES)}")
            if token in tokens:
                raise ValueError(f"{path} line {number}: this token already appears on an earlier line")
            tokens[token] = roles
    return tokens
