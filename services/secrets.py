"""The credentials of one deployment, generated at start (`pdserve up`, compose's `secrets`
service): random tokens in files of a directory only its owner can read, handed to each
component as `*_FILE` environment variables (never argv: `ps` shows argv to every user).

    pdserve secrets --dir DIR     # creates what is missing, keeps what is there; prints nothing secret

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN_BYTES = 32


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


def _token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _write_private(path: Path, text: str) -> None:
    """Creates `path` readable by its owner only (never briefly wider: the mode is set at open)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read(path: Path) -> str:
    return path.read_text().strip()


def ensure_secrets(directory: str | Path) -> DeploymentSecrets:
    """Creates the directory (0700) and every missing file; existing ones are kept (a restarted
    compose stack keeps its credentials, and the objects its store holds stay checkable)."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in ("kv-worker-token", "kv-admin-token", "kv-integrity-key", "worker-token", "redis-password"):
        if not (d / name).exists():
            _write_private(d / name, _token() + "\n")
    if not (d / "kv-auth").exists():
        _write_private(d / "kv-auth", f"# pdserve KV store credentials: <token> <roles>\n"
                                      f"{_read(d / 'kv-worker-token')} producer,consumer\n"
                                      f"{_read(d / 'kv-admin-token')} admin\n")
    if not (d / "redis.conf").exists():
        _write_private(d / "redis.conf", f"requirepass {_read(d / 'redis-password')}\n")
    return DeploymentSecrets(d)


def add_secrets_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("secrets", help="generate a deployment's credentials into a directory")
    p.add_argument("--dir", required=True, help="directory for the credential files (created 0700)")
    p.add_argument("--redis-uid", type=int, default=None,
                   help="hand redis.conf and redis-password to this uid (a Redis container's user); "
                        "the directory then opens to others for traversal only (0711)")
    p.set_defaults(func=run_secrets)


def run_secrets(args: argparse.Namespace) -> int:
    s = ensure_secrets(args.dir)
    if args.redis_uid is not None:
        for name in ("redis.conf", "redis-password"):
            os.chown(s.dir / name, args.redis_uid, args.redis_uid)
        os.chmod(s.dir, 0o711)  # names are not listable; each file stays 0600 for its owner
    print(f"pdserve credentials in {s.dir} (owner-only)", flush=True)
    return 0
