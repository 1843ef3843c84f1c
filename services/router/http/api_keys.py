"""Where the router's API keys come from (read by the router, `pdserve up` and the autoscaler).

Keys come from `$PDSERVE_API_KEY` (comma-separated for several), a key file (`--api-key-file`
or `$PDSERVE_API_KEY_FILE`: one key per line, `#` comments) and `--api-key` (argv, which other
users of the host see in `ps`: warned).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)


def load_api_keys(argv_key: str | None = None, key_file: str | None = None,
                  environ: Mapping[str, str] = os.environ, warn: bool = True) -> tuple[str, ...]:
    """Every configured key, in order, without repeats: $PDSERVE_API_KEY's, the key file's
    (`key_file`, else $PDSERVE_API_KEY_FILE), then `argv_key` (warned about, with `warn`)."""
    keys = [k.strip() for k in environ.get("PDSERVE_API_KEY", "").split(",")]
    path = key_file or environ.get("PDSERVE_API_KEY_FILE")
    if path:
        keys += read_key_file(path)
    if argv_key and warn:
        logger.warning("--api-key on the command line is visible to other users of this host (ps); "
                       "use $PDSERVE_API_KEY or --api-key-file")
    if argv_key:
        keys += [k.strip() for k in argv_key.split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


def read_key_file(path: str) -> list[str]:
    """The keys of a key file: one per line; blank lines and `#` comments are skipped."""
    with open(path) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return [line for line in lines if line]


def load_admin_keys(key_file: str | None = None, environ: Mapping[str, str] = os.environ
                    ) -> tuple[str, ...]:
    """The admin API's keys: $PDSERVE_ADMIN_API_KEY (comma-separated) and the key file
    (`key_file`, else $PDSERVE_ADMIN_API_KEY_FILE)."""
    keys = [k.strip() for k in environ.get("PDSERVE_ADMIN_API_KEY", "").split(",")]
    path = key_file or environ.get("PDSERVE_ADMIN_API_KEY_FILE")
    if path:
        keys += read_key_file(path)
    return tuple(dict.fromkeys(k for k in keys if k))


def first_api_key(argv_key: str | None = None, key_file: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client of the admin API (the autoscaler) sends: the first admin key, else the
    first API key."""
    keys = load_admin_keys(environ=environ) + load_api_keys(argv_key, key_file, environ, warn=False)
    return keys[0] if keys else None
