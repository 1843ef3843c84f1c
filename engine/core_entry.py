"""The engine core process's entry point, light to import: it ignores SIGINT before anything
heavy (torch) loads, then runs engine/core_proc.py. A terminal's Ctrl-C reaches the whole process
group, the core included, and its parent owns the core's life (shutdown message, then SIGTERM):
without this, a Ctrl-C during the core's seconds of imports is a KeyboardInterrupt traceback."""

from __future__ import annotations

import signal


def main(config_bytes: bytes, input_address: str, output_address: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.core_proc import run_engine_core

    run_engine_core(config_bytes, input_address, output_address)
