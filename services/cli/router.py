"""`pdserve router`: the OpenAI-compatible HTTP router over gRPC workers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from engine.config import DEFAULT_MODEL
from services import tracing
from services.cli.engine_args import add_tracing_arg


def add_router(subparsers: Any) -> None:
    p = subparsers.add_parser("router", help="run the OpenAI-compatible HTTP router over gRPC workers")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill worker (repeatable); none = colocated mode")
    p.add_argument("--decode", action="append", required=True, metavar="HOST:PORT",
                   help="a decode (or colocated) worker (repeatable)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the served model name")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: --model)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest prompt + output a request may ask for (default: the smallest "
                        "max_model_len the workers report; 4096 until one has)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout-s", type=float, default=60.0)
    p.add_argument("--decode-timeout-s", type=float, default=600.0)
    p.add_argument("--policy", choices=["prefix_aware", "least_loaded"], default="prefix_aware",
                   help="how a worker is chosen in each pool")
    p.add_argument("--prefix-index", choices=["events", "approximate"], default="events",
                   help="prefix_aware: score a worker on the blocks its KV cache events say it holds "
                        "(where it publishes them; the approximate index while its stream is "
                        "missing or behind), or only on the prompts sent to it (approximate)")
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="prompts with at most this many uncached tokens skip the prefill pool "
                        "(conditional disaggregation; 0 = always disaggregate)")
    p.add_argument("--handoff", choices=["early", "after-prefill"], default="early",
                   help="split mode: send each decode call with its prefill (early: the decode "
                        "worker loads the KV while the prefill runs) or after it")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="429 once every worker of a pool has this many queued requests")
    p.add_argument("--max-inflight", type=int, default=4096, help="429 beyond this many requests")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; visible in ps: prefer "
                        "$PDSERVE_API_KEY (comma-separated keys) or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="API keys, one per line, '#' comments (default: $PDSERVE_API_KEY_FILE); "
                        "any configured key is accepted")
    p.add_argument("--tenant-cache-salt", action="store_true",
                   help="each API key is a tenant: KV (prefix caches, KV store) is shared only among "
                        "requests made with the same key; the admin API then needs an admin key "
                        "($PDSERVE_ADMIN_API_KEY or $PDSERVE_ADMIN_API_KEY_FILE)")
    p.add_argument("--stall-timeout-s", type=float, default=5.0,
                   help="a decode stream with no token and no worker heartbeat this long moves to "
                        "another worker")
    p.add_argument("--max-migrations", type=int, default=3, help="moves allowed per sample")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger bodies get 413")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a request's headers must arrive within this (else 408)")
    p.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request's body must arrive within this after its headers (else 408)")
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited listening socket instead of binding --host/--port "
                        "(pdserve up holds the port across router restarts)")
    p.add_argument("--disable-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (with an API key they need it)")
    p.add_argument("--worker-networks", action="append", default=None, metavar="CIDR[,CIDR]",
                   help="networks a worker added through the admin API may be in (repeatable; default: "
                        "the private ones, 10/8, 172.16/12, 192.168/16, fc00::/7); loopback, link-local "
                        "(169.254.169.254: cloud metadata) and public addresses must be listed")
    p.add_argument("--liveness-port", type=int, default=0,
                   help="also answer GET /livez on this port, from a thread of its own: 200 while the "
                        "event loop ran within --liveness-stall-s, whatever a request does to it "
                        "(0 = off; /livez on --port is answered by the loop)")
    p.add_argument("--liveness-stall-s", type=float, default=30.0,
                   help="the liveness port answers 503 once the event loop has not run this long")
    p.add_argument("--max-heavy-per-caller", type=int, default=2,
                   help="bodies over 256 KiB under way per caller (API key, else address); more "
                        "get 429 (every body over 4 KiB is prepared off the event loop)")
    p.add_argument("--max-heavy", type=int, default=8,
                   help="bodies over 256 KiB under way in all; more get 429")
    p.add_argument("--max-pooled-per-caller", type=int, default=32,
                   help="bodies over 4 KiB (prepared off the event loop) under way per caller; more get 429")
    p.add_argument("--max-pooled", type=int, default=128,
                   help="bodies over 4 KiB under way in all; more get 429")
    p.add_argument("--structured-outputs-backend", choices=["auto", "xgrammar", "guidance"], default="auto",
                   help="the grammar backend of structured outputs (response_format, structured_outputs, "
                        "guided_*) unless a request names one in guided_decoding_backend; auto: xgrammar, "
                        "else llguidance for what xgrammar cannot compile or enforce")
    w = p.add_argument_group("workers (the token comes from $PDSERVE_WORKER_TOKEN or "
                             "$PDSERVE_WORKER_TOKEN_FILE, never argv)")
    w.add_argument("--worker-tls-ca", default=os.environ.get("PDSERVE_WORKER_TLS_CA"), metavar="PATH",
                   help="reach workers over TLS, verified by this CA (default: $PDSERVE_WORKER_TLS_CA)")
    w.add_argument("--worker-tls-cert", default=os.environ.get("PDSERVE_WORKER_TLS_CERT"), metavar="PATH",
                   help="client certificate for workers' mutual TLS (default: $PDSERVE_WORKER_TLS_CERT)")
    w.add_argument("--worker-tls-key", default=os.environ.get("PDSERVE_WORKER_TLS_KEY"), metavar="PATH",
                   help="the --worker-tls-cert's key (default: $PDSERVE_WORKER_TLS_KEY)")
    t = p.add_argument_group("chat template and tool calling (vLLM's flags)")
    t.add_argument("--chat-template", default=None, metavar="PATH|NAME",
                   help="a Jinja chat template replacing the tokenizer's: a file, or one pdserve ships "
                        "(hermes_tools: ChatML with Hermes tool calls, for the default model); '' = the "
                        "tokenizer's own")
    t.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "phi4_mini_json"],
                   help="how the tool calls a model writes are found (vLLM's names): hermes "
                        "(<tool_call>{...}</tool_call>: Qwen), llama3_json (bare JSON: Llama 3.x), "
                        "mistral ([TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...}: Mistral, Mixtral), "
                        "phi4_mini_json (functools[...]: Phi-4-mini)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default with tools); needs --tool-call-parser')
    t.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a chat reply's <think>...</think> off its content into reasoning (and "
                        "reasoning_content); deepseek_r1: the reply starts in its reasoning unless the "
                        "prompt closed it (the start tag may be absent)")
    r = p.add_argument_group("the Responses API's store (store, previous_response_id, "
                             "GET /v1/responses/{id})")
    r.add_argument("--enable-responses-store", action="store_true",
                   help="keep responses sent with store=true in memory, per tenant (default: off, as "
                        "vLLM's; a request's store=true is then answered with store: false)")
    r.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                   help="the most responses kept; past it the least recently used go (default: %(default)s)")
    r.add_argument("--responses-store-mb", type=int, default=256, metavar="MB",
                   help="the most memory their JSON takes (default: %(default)s)")
    p.add_argument("--log-level", default="WARNING")
    add_tracing_arg(p)
    p.set_defaults(func=_run_router)


def _networks(given: list[str] | None) -> tuple[str, ...]:
    from services.router.config import PRIVATE_NETWORKS

    if not given:
        return PRIVATE_NETWORKS
    return tuple(n.strip() for spec in given for n in spec.split(",") if n.strip())


def _run_router(args: argparse.Namespace) -> int:
    from kvstore.credentials import TLSFiles, read_secret
    from services.procs import PortInUseError
    from services.router.app import RouterConfig, create_app, liveness_server
    from services.router.dispatch.dispatcher import DispatchOptions
    from services.router.http.api_keys import load_admin_keys, load_api_keys
    from services.router.http.edge import bind, serve
    from services.worker.auth import TOKEN_ENV, WorkerAccess

    dispatch = DispatchOptions(prefill=tuple(args.prefill), decode=tuple(args.decode),
                               prefill_timeout_s=args.prefill_timeout_s,
                               decode_timeout_s=args.decode_timeout_s, prefill_policy=args.policy,
                               decode_policy=args.policy, local_prefill_tokens=args.local_prefill_tokens,
                               prefix_index=args.prefix_index,
                               stall_timeout_s=args.stall_timeout_s, max_migrations=args.max_migrations,
                               early_handoff=args.handoff == "early",
                               worker_access=WorkerAccess(read_secret(TOKEN_ENV), TLSFiles(
                                   args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca)))
    try:
        config = RouterConfig(model=args.model, tokenizer=args.tokenizer or args.model,
                              max_model_len=args.max_model_len, dispatch=dispatch,
                              api_keys=load_api_keys(args.api_key, args.api_key_file),
                              tenant_cache_salt=args.tenant_cache_salt, admin_keys=load_admin_keys(),
                              max_waiting=args.max_waiting, max_inflight=args.max_inflight,
                              max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout_s,
                              body_timeout_s=args.body_timeout_s, disable_docs=args.disable_docs,
                              chat_template=args.chat_template or None,
                              tool_call_parser=args.tool_call_parser,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              reasoning_parser=args.reasoning_parser,
                              enable_responses_store=args.enable_responses_store,
                              responses_store_size=args.responses_store_size,
                              responses_store_mb=args.responses_store_mb,
                              structured_outputs_backend=args.structured_outputs_backend,
                              max_heavy_per_caller=args.max_heavy_per_caller, max_heavy=args.max_heavy,
                              max_pooled_per_caller=args.max_pooled_per_caller, max_pooled=args.max_pooled,
                              worker_networks=_networks(args.worker_networks))
    except ValueError as e:  # a flag the config refuses: the message names it
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    liveness = None
    tracing.setup("pdserve-router", args.otlp_traces_endpoint)
    try:
        if args.fd is None:
            bind(args.host, args.port).close()  # a taken port fails here, before the tokenizer loads
        app = create_app(config)
        if args.liveness_port:
            try:
                liveness = liveness_server(app, args.host, args.liveness_port, args.liveness_stall_s)
            except OSError as e:
                raise PortInUseError(f"--liveness-port {args.liveness_port}: {e}") from e
            liveness.start()
        serve(app, config, args.host, args.port, log_level=args.log_level.lower(), fd=args.fd)
    except PortInUseError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    finally:
        if liveness is not None:
            liveness.stop()
        tracing.shutdown()
    print(f"pdserve router stopped ({args.host}:{args.port})", flush=True)
    return 0
