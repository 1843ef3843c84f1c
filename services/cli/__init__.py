"""The `pdserve` command line. One subcommand per task; each registers its own parser.

    pdserve generate --prompt "Hello" --max-tokens 32 --temperature 0
    pdserve generate --chat --prompt "What is the capital of France?" --n 2 --seed 1

New subcommands add an `add_<name>(subparsers)` function (a module of this package, or its own
package's parser) to `SUBCOMMANDS`; it sets `func` to a handler taking the parsed arguments
and returning an exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from services.cli.generate import add_generate
from services.cli.router import add_router
from services.cli.worker import add_worker, worker_engine_config

__all__ = ["build_parser", "main", "version_text", "worker_engine_config"]


def _add_kvstore(subparsers: Any) -> None:
    from kvstore.service import add_kvstore_parser

    add_kvstore_parser(subparsers)


def _add_up(subparsers: Any) -> None:
    from services.up import add_up_parser

    add_up_parser(subparsers)


def _add_autoscaler(subparsers: Any) -> None:
    from services.autoscaler.cli import add_autoscaler_parser

    add_autoscaler_parser(subparsers)


def _add_secrets(subparsers: Any) -> None:
    from services.secrets import add_secrets_parser

    add_secrets_parser(subparsers)


def _add_drain(subparsers: Any) -> None:
    from services.drain import add_drain_parser

    add_drain_parser(subparsers)


SUBCOMMANDS: list[Callable[[Any], None]] = [add_generate, _add_kvstore, add_worker, add_router,
                                            _add_up, _add_autoscaler, _add_secrets, _add_drain]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated "
                                     "prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print pdserve's version (and torch's, Python's) and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def version_text() -> str:
    """`pdserve --version`: the installed package's version, with torch's and Python's."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return f"pdserve {of('pdserve')} (torch {of('torch')}, Python {platform.python_version()})"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (`pdserve`); returns the exit code."""
    try:
        parser = build_parser()  # option defaults read PDSERVE_* variables, which may be malformed
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except ValueError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler is in place (loading...)
        print(f"pdserve {args.command}: interrupted", file=sys.stderr)
        return 130
    return code
