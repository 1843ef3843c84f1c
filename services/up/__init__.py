"""`pdserve up`: the whole system as local processes — the KV store (memory backend), prefill
workers, decode workers and the router — started in order, each waited for until it serves;
prints where to send requests. A component that exits while the system runs is restarted
(services/supervisor.py: backoff, a restart budget, each restart logged) and rejoins its pool;
only Ctrl-C (or SIGTERM) stops everything. `--colocated` runs workers that prefill and decode
themselves behind the same router, for comparison.

    pdserve up [--model M] [--prefill 1] [--decode 1] [--port 8000] [--colocated]

Every port is checked before anything starts: one that is taken is a one-line error naming the
port and the component, and the exit code is 1.

Credentials (docs/security.md): `up` generates the deployment's tokens at start into a private
directory (services/secrets.py; `--secrets-dir` keeps them somewhere chosen) and gives each
component its own by `*_FILE` environment variables, never argv; `--no-auth` runs everything
open (trusted networks only).
"""

from services.up.args import add_up_parser

__all__ = ["add_up_parser"]
