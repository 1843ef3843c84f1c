"""The credentials of one deployment, generated at start (`pdserve up`, compose's `secrets`
service): random tokens in files of a directory only its owner can read, handed to each
component as `*_FILE` environment variables (never argv: `ps` shows argv to every user).

    pdserve secrets --dir DIR     # creates what is missing, keeps what is there; prints nothing secret
    pdserve secrets --dir DIR --share worker=/run/w --owner 10001   # + a copy of a role's files

`--share ROLE=DIR` copies only what that component needs into DIR (compose gives each service
its own volume this way, so the router cannot read the integrity key, nor the store the
workers' tokens): roles `store`, `worker`, `router`, `redis` (SHARES below).

Files (each 0600, the directory 0700):
    kv-auth            the KV store's token file: `<token> <roles>` per line
    kv-worker-token    the workers' store credential (producer, consumer)
    kv-admin-token     the operator's store credential (admin: delete, stats)
    kv-integrity-key   the key of the KV checksums (workers only; the store never sees it)
    worker-token       the router's credential on the workers' gRPC ports
    redis-password     Redis's password (compose), and redis.conf holding it for redis-server
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN_BYTES = 32
TOKENS = ("kv-worker-token", "kv-admin-token", "kv-integrity-key", "worker-token", "redis-password")
# What each component reads (the store's admin token is for its own healthcheck).
SHARES = {"store": ("kv-auth", "redis-password", "kv-admin-token"),
          "worker": ("kv-worker-token", "kv-integrity-key", "worker-token"),
          "router": ("worker-token",),
          "redis": ("redis.conf", "redis-password")}


@dataclass(frozen=True)
class DeploymentSecrets:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def store_env(self) -> dict[str, str]:
        """What the KV store process needs."""
        return {"PDSERVE_KV_AUTH_FILE": self.path("kv-auth"),
                "PDSERVE_REDIS_PASSWORD_FILE": self.path("redis-password")}

    def worker_env(self) -> dict[str, str]:
        """What a worker needs: its store credential, the checksum key, the router's token."""
        return {"PDSERVE_KV_TOKEN_FILE": self.path("kv-worker-token"),
                "PDSERVE_KV_INTEGRITY_KEY_FILE": self.path("kv-integrity-key"),
                "PDSERVE_WORKER_TOKEN_FILE": self.path("worker-token")}

    def router_env(self) -> dict[str, str]:
        """What the router needs: the token it presents to the workers."""
        return {"PDSERVE_WORKER_TOKEN_FILE": self.path("worker-token")}

    def admin_env(self) -> dict[str, str]:
        """The operator's store credential (admin role: stats, delete)."""
        return {"PDSERVE_KV_TOKEN_FILE": self.path("kv-admin-token")}


# Every credential variable a component reads (each also as NAME_FILE), and which kinds of
# component read it: `component_env` gives each process only its own.
CREDENTIAL_READERS: dict[str, frozenset[str]] = {
    "PDSERVE_API_KEY": frozenset({"router"}),
    "PDSERVE_ADMIN_API_KEY": frozenset({"router"}),
    "PDSERVE_WORKER_TOKEN": frozenset({"router", "worker"}),
    "PDSERVE_WORKER_TLS_CA": frozenset({"router", "worker"}),
    "PDSERVE_WORKER_TLS_CERT": frozenset({"router", "worker"}),
    "PDSERVE_WORKER_TLS_KEY": frozenset({"router", "worker"}),
    "PDSERVE_KV_TOKEN": frozenset({"worker"}),
    "PDSERVE_KV_INTEGRITY_KEY": frozenset({"worker"}),
    "PDSERVE_KV_TLS_CA": frozenset({"worker"}),
    "PDSERVE_KV_TLS_CERT": frozenset({"worker"}),
    "PDSERVE_KV_TLS_KEY": frozenset({"worker"}),
    "PDSERVE_KV_AUTH": frozenset({"kvstore"}),
    "PDSERVE_REDIS_PASSWORD": frozenset({"kvstore"}),
}
# What a worker's engine core (its child process) reads of them: the store's, not the router's.
ENGINE_CORE_DROPS = ("PDSERVE_WORKER_TOKEN", "PDSERVE_WORKER_TLS_CA", "PDSERVE_WORKER_TLS_CERT",
                     "PDSERVE_WORKER_TLS_KEY")


def component_env(kind: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the credentials a `kind` component ("kvstore", "router", or "worker" for
    prefill, decode and colocated) does not read."""
    kind = "worker" if kind in ("prefill", "decode", "colocated") else kind
    return {k: v for k, v in environ.items()
            if kind in CREDENTIAL_READERS.get(k.removesuffix("_FILE"), frozenset({kind}))}


def drop_from_environ(names: Sequence[str]) -> None:
    """Removes `names` (and their _FILE variants) from this process's environment, so the
    processes it starts from now on do not inherit them."""
    for name in names:
        os.environ.pop(name, None)
        os.environ.pop(f"{name}_FILE", None)


def _token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _write_private(path: Path, text: str) -> None:
    """Creates `path` readable by its owner only (never briefly wider: the mode is set at open)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _replace_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    _write_private(tmp, text)
    os.replace(tmp, path)


def ensure_secrets(directory: str | Path) -> DeploymentSecrets:
    """Creates the directory (0700) and every missing token; existing ones are kept (a restarted
    compose stack keeps its credentials, and the objects its store holds stay checkable) and
    made owner-only again. `kv-auth` and `redis.conf` are derived from the tokens every time, so
    they always agree with them."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in TOKENS:
        if (d / name).exists():
            os.chmod(d / name, 0o600)
        else:
            _write_private(d / name, _token() + "\n")
    _replace_private(d / "kv-auth", f"# pdserve KV store credentials: <token> <roles> (generated "
                                    f"from kv-worker-token and kv-admin-token)\n"
                                    f"{_read(d / 'kv-worker-token')} producer,consumer\n"
                                    f"{_read(d / 'kv-admin-token')} admin\n")
    _replace_private(d / "redis.conf", f"requirepass {_read(d / 'redis-password')}\n")
    return DeploymentSecrets(d)


def share(creds: DeploymentSecrets, role: str, dest: str | Path, owner: int | None = None) -> None:
    """Copies the files component `role` reads into `dest` (0700, files 0600), owned by `owner`
    when given (root only); files of other roles never go there."""
    if role not in SHARES:
        raise ValueError(f"--share: role must be one of {sorted(SHARES)}, got {role!r}")
    d = Path(dest)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for stale in d.iterdir():  # a share holds exactly its role's files
        if stale.name not in SHARES[role]:
            stale.unlink()
    for name in SHARES[role]:
        _replace_private(d / name, (creds.dir / name).read_text())
        if owner is not None:
            os.chown(d / name, owner, owner)
    os.chmod(d, 0o700)
    if owner is not None:
        os.chown(d, owner, owner)


def add_secrets_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("secrets", help="generate a deployment's credentials into a directory")
    p.add_argument("--dir", required=True, help="directory for the credential files (created 0700)")
    p.add_argument("--share", action="append", default=[], metavar="ROLE=DIR",
                   help=f"also copy the files of one component ({', '.join(SHARES)}) into DIR")
    p.add_argument("--owner", type=int, default=None, metavar="UID",
                   help="owner of the --share copies (needs root); ROLE=DIR:UID overrides it")
    p.set_defaults(func=run_secrets)


def run_secrets(args: argparse.Namespace) -> int:
    s = ensure_secrets(args.dir)
    for spec in args.share:
        role, sep, rest = spec.partition("=")
        dest, _, uid = rest.rpartition(":") if ":" in rest else (rest, "", "")
        if not sep or not dest:
            raise ValueError(f"--share {spec!r}: expected ROLE=DIR or ROLE=DIR:UID")
        share(s, role, dest, int(uid) if uid else args.owner)
    print(f"pdserve credentials in {s.dir} (owner-only)", flush=True)
    return 0
