"""`pdserve up`'s flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from engine.config import DEFAULT_MODEL
from services.up import kv_events as up_kv_events


class DefaultsHelp(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help says it (a None default must)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # a switch
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def add_up_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("up", help="start the KV store, workers and router locally",
                              formatter_class=DefaultsHelp)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a catalog model (default %(default)s; gemma-3-270m), a local .gguf file, a "
                        "local Hugging Face folder or a hub id (docs/models.md)")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers (with --autoscale: the fewest)")
    p.add_argument("--decode", type=int, default=1,
                   help="decode (or, with --colocated, colocated) workers (with --autoscale: the fewest)")
    p.add_argument("--colocated", action="store_true",
                   help="workers prefill and decode themselves (no KV transfer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address every component listens on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--kvstore-port", type=int, default=50071, help="the KV store's gRPC port")
    p.add_argument("--prefill-port", type=int, default=50051, help="first prefill worker's port")
    p.add_argument("--decode-port", type=int, default=50061, help="first decode worker's port")
    p.add_argument("--kvstore-capacity", default="4GiB", help="the KV store's memory")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per worker, per rank under tensor parallelism (default: "
                        "torch's, one per CPU the worker may use, shared out between its ranks)")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="each prefill worker's tensor-parallel size (processes, one rank each)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="each decode (or colocated) worker's tensor-parallel size; prefill and "
                        "decode may differ (the KV hand-off re-shards)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on the decode (and colocated) workers, vLLM's JSON, "
                        "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                        "(default: off)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="each worker's KV cache (default on the CPU: PDSERVE_CPU_KVCACHE_SPACE GiB "
                        "when set, else half the memory free at start divided among the workers "
                        "up starts, the autoscaler's maxima included)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest prompt + output (default: the model's context length)")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prefill workers' step budget (default: the worker's)")
    p.add_argument("--prefill-scheduling-policy", default=None, choices=["fcfs", "priority", "sjf"],
                   help="prefill workers' scheduling policy (default: the worker's, sjf)")
    p.add_argument("--startup-timeout-s", type=float, default=None,
                   help="how long the components may take to start (default: 600 s, plus 120 s for "
                        "each GiB of the model's weight files beyond the first)")
    p.add_argument("--unresponsive-s", type=float, default=60.0,
                   help="a running component that has not answered its liveness check this long is "
                        "killed and restarted (the clock starts when the watch begins, after start-up)")
    p.add_argument("--router-liveness-port", type=int, default=None,
                   help="the router answers liveness checks here, off its event loop (default: --port "
                        "+ 1000; 0: /livez on --port)")
    p.add_argument("--metrics-port-offset", type=int, default=1000,
                   help="each worker serves Prometheus /metrics on its gRPC port + this (0 = off); "
                        "the router's is at /metrics")
    up_kv_events.add_args(p)
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="every component sends request traces (OTLP) here; the standard "
                        "OTEL_EXPORTER_OTLP_* variables work too (default: off; docs/tracing.md)")
    p.add_argument("--prefill-cpus", default=None, metavar="LIST",
                   help="pin prefill workers (and their engine cores) to these CPUs, e.g. 0 or 0-1 "
                        "(default: unpinned)")
    p.add_argument("--decode-cpus", default=None, metavar="LIST",
                   help="pin decode (or colocated) workers to these CPUs (default: unpinned)")
    p.add_argument("--kvstore-cpus", default=None, metavar="LIST",
                   help="pin the KV store to these CPUs (default: unpinned)")
    p.add_argument("--router-cpus", default=None, metavar="LIST",
                   help="pin the router to these CPUs (default: unpinned)")
    p.add_argument("--policy", choices=["prefix_aware", "least_loaded"], default="prefix_aware",
                   help="how the router picks a worker of a pool: the one holding the longest cached "
                        "prefix of the prompt (spread by load), or the least loaded")
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="prompts with at most this many uncached tokens skip the prefill pool")
    p.add_argument("--handoff", choices=["early", "after-prefill"], default="early",
                   help="send each decode call with its prefill (early) or after it")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY, "
                        "comma-separated keys); visible in ps: prefer the variable or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="router: API keys, one per line, '#' comments (default: none)")
    p.add_argument("--tenant-cache-salt", action="store_true",
                   help="router: each API key is a tenant whose KV no other key's requests share")
    p.add_argument("--no-auth", action="store_true",
                   help="no credentials: the KV store and the workers take calls from anyone who "
                        "reaches their ports (trusted networks only)")
    p.add_argument("--secrets-dir", type=Path, default=None,
                   help="keep the generated credentials here (created 0700; existing ones reused) "
                        "(default: a private temporary directory, removed at exit)")
    p.add_argument("--stall-timeout-s", type=float, default=None,
                   help="router: a decode stream silent this long moves to another worker "
                        "(default: the router's, 5 s)")
    p.add_argument("--chat-template", default=None, metavar="PATH|NAME",
                   help="router: the chat template (default: hermes_tools, shipped with pdserve, for the "
                        "default model; the tokenizer's own for any other; '' = the tokenizer's own); "
                        "tool calls are parsed with the hermes parser, tool_choice \"auto\" enabled")
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "phi4_mini_json"],
                   help="router: how tool calls are found in replies (vLLM's names); default: the "
                        "model family's (llama3_json for Llama, mistral for Mistral/Mixtral, "
                        "phi4_mini_json for Phi-3/Phi-4-mini, else hermes)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="router: split chat replies' <think>...</think> into reasoning (vLLM's flag; "
                        "qwen3 for Qwen3 models, deepseek_r1 for DeepSeek-R1 and QwQ); default: off")
    p.add_argument("--restart-budget", type=int, default=5,
                   help="restarts of one component allowed within --restart-window-s")
    p.add_argument("--restart-window-s", type=float, default=300.0,
                   help="the window of --restart-budget, in seconds")
    p.add_argument("--state-file", type=Path, default=None,
                   help="keep a JSON file of the components (name, pid, port, state, restarts) "
                        "(default: none)")
    p.add_argument("--enable-responses-store", action="store_true",
                   help="router: keep /v1/responses sent with store=true in memory, for "
                        "previous_response_id and GET /v1/responses/{id} (vLLM keeps it off too)")
    from services.autoscaler.local import add_autoscale_args

    add_autoscale_args(p)
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from services.up.run import run_up

    return run_up(args)
