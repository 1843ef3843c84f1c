"""The `pdserve` command line. One subcommand per task; each registers its own parser.

    pdserve generate --prompt "Hello" --max-tokens 32 --temperature 0
    pdserve generate --chat --prompt "What is the capital of France?" --n 2 --seed 1

New subcommands (`kvstore`, `up`, ...) add a `_add_<name>(subparsers)` function to
`SUBCOMMANDS`; it sets `func` to a handler taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import DEFAULT_MODEL
from engine.kv_events.config import KVEventsConfig
from engine.spec.config import SpeculativeConfig
from services import tracing


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="a catalog model (smollm2-135m-instruct, the default; gemma-3-270m), a local "
                            ".gguf file, a local Hugging Face folder or a hub id (docs/models.md)")
    group.add_argument("--tokenizer", default=None)
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights, activations and KV cache (default auto: bfloat16 on CUDA and "
                            "on CPUs with AVX-512 BF16 or AMX, else float32; PDSERVE_AUTO_DTYPE "
                            "overrides auto's choice). float32 equals transformers token for token")
    group.add_argument("--device", default="cpu")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--kv-cache-gib", type=float, default=None,
                       help="KV cache size (default on the CPU: PDSERVE_CPU_KVCACHE_SPACE GiB when set, "
                            "else --cpu-kv-cache-share of the memory free at start divided by "
                            "--kv-cache-sharers; on CUDA: what --gpu-memory-utilization leaves)")
    group.add_argument("--cpu-kv-cache-share", type=float, default=0.5,
                       help="CPU: the share of the memory available at start that the host's "
                            "engines' KV caches take together (default 0.5)")
    group.add_argument("--kv-cache-sharers", type=int, default=1,
                       help="CPU: how many engines on this host divide that share (pdserve up sets "
                            "it to the number of workers it runs; default 1)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="a hybrid model (Gemma 2/3: windowed and full layers) keeps every "
                            "layer's blocks for the whole request, as a model without windows "
                            "(default: its windowed layers free what their window has left)")
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--num-threads", type=int, default=None,
                       help="torch threads (per rank with --tensor-parallel-size; default: the "
                            "machine's cores, shared out between the ranks)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over this many processes on this host, one rank each "
                            "(tensor parallelism; CPU: gloo). A prefill and a decode worker of "
                            "different sizes hand KV off to each other (docs/tensor-parallel.md)")
    group.add_argument("--tp-timeout-s", type=float, default=60.0,
                       help="how long a rank waits for the others in a collective: a rank that "
                            "hangs fails the step after this, and the worker restarts its engine")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
                            "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' (default: "
                            "off; docs/speculative-decoding.md)")
    group.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help="publish KV cache events, vLLM's JSON: e.g. '{\"enable_kv_cache_events\": "
                            "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                            "\"tcp://*:5558\", \"topic\": \"kv-events\"}' (default: off; "
                            "docs/kv-events.md)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step, longer prefills are chunked (default 2048; "
                            "512 for prefill workers on the CPU, whose steps are compute-bound "
                            "from a few hundred tokens on: smaller steps finish short prompts "
                            "sooner at no cost in throughput)")
    group.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority", "sjf"],
                       help="sjf: fewest prompt tokens left first (default for prefill workers); "
                            "fcfs otherwise")
    group.add_argument("--sjf-max-wait-s", type=float, default=10.0,
                       help="sjf: a request waiting this long goes ahead of shorter ones")
    group.add_argument("--log-level", default="WARNING")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, block_size=args.block_size,
                kv_cache_gib=args.kv_cache_gib, num_kv_blocks=args.num_kv_blocks,
                cpu_kv_cache_share=args.cpu_kv_cache_share, kv_cache_sharers=args.kv_cache_sharers,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager,
                disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                num_threads=args.num_threads, sjf_max_wait_s=args.sjf_max_wait_s,
                tensor_parallel_size=args.tensor_parallel_size, tp_timeout_s=args.tp_timeout_s,
                speculative_config=SpeculativeConfig.parse(args.speculative_config),
                kv_events_config=KVEventsConfig.parse(args.kv_events_config),
                **{k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                     ("scheduling_policy", args.scheduling_policy))
                   if v is not None})  # unset: EngineConfig's defaults


def _add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate completions offline and print them")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per completion instead of plain text")
    _add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos)
    llm = LLM(**_engine_kwargs(args))
    try:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            outputs = llm.chat([[*system, {"role": "user", "content": p}] for p in args.prompt],
                               params, use_tqdm=False)
        else:
            outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    finally:
        llm.shutdown()
    many = len(outputs) > 1 or args.n > 1
    for i, out in enumerate(outputs):
        for sample in out.outputs:
            if args.json:
                print(json.dumps({"prompt_index": i, "index": sample.index, "text": sample.text,
                                  "token_ids": list(sample.token_ids),
                                  "finish_reason": sample.finish_reason}))
                continue
            if many:
                print(f"=== prompt {i}, sample {sample.index} ===")
            print(sample.text)
    return 0


def _add_kvstore(subparsers: Any) -> None:
    from kvstore.service import add_kvstore_parser

    add_kvstore_parser(subparsers)


def _add_worker(subparsers: Any) -> None:
    p = subparsers.add_parser("worker", help="run a prefill, decode or colocated gRPC worker")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    _add_tracing_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="default 50051 (prefill) or 50061 (decode, colocated); 0 = any free port")
    p.add_argument("--kv-store-url", default="grpc://127.0.0.1:50071",
                   help="the KV store, or several front-ends of one (a redis-cluster store): "
                        "grpc://a:50071,grpc://b:50071 or dns:name:50071 (every address)")
    p.add_argument("--kv-load-mode", default="auto", choices=["auto", "async", "layerwise"],
                   help="decode: load KV from the store inside the step that schedules the request "
                        "(layerwise), beside the running steps (async), or layer-wise up to "
                        "--kv-layerwise-max-tokens and async above (auto)")
    p.add_argument("--kv-layerwise-max-tokens", type=int, default=2048)
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="on SIGTERM, how long in-flight calls may finish")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use, the router's --model: the metrics' model_name "
                        "label (default: --model)")
    p.add_argument("--reuse-port", action="store_true",
                   help="let several worker processes share --port (SO_REUSEPORT); by default a "
                        "taken port is an error")
    a = p.add_argument_group("security (the token comes from $PDSERVE_WORKER_TOKEN or "
                             "$PDSERVE_WORKER_TOKEN_FILE, never argv)")
    a.add_argument("--tls-cert", default=None, metavar="PATH", help="serve TLS with this certificate (PEM)")
    a.add_argument("--tls-key", default=None, metavar="PATH", help="the --tls-cert's private key (PEM)")
    a.add_argument("--tls-client-ca", default=None, metavar="PATH",
                   help="mutual TLS: clients need a certificate this CA signed")
    a.add_argument("--no-auth", action="store_true",
                   help="allow a non-loopback --host with neither token nor client certificates "
                        "(a trusted network only)")
    g = p.add_argument_group("health (the engine core is watched; see docs/operations.md)")
    g.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="a Decode stream with nothing new gets an empty chunk this often")
    g.add_argument("--core-unready-s", type=float, default=3.0,
                   help="engine core silent this long: NOT_SERVING (no new requests) until it speaks")
    g.add_argument("--core-silence-s", type=float, default=10.0,
                   help="engine core silent this long: killed and restarted")
    g.add_argument("--step-timeout-s", type=float, default=300.0,
                   help="one engine step running this long: the core is killed and restarted")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="engine core restarts allowed in 10 minutes; past that the worker exits 1")
    _add_engine_args(p)
    p.set_defaults(func=_run_worker)


def worker_engine_config(args: argparse.Namespace) -> Any:
    """The worker's EngineConfig: prefill workers default to shortest-first scheduling and, on
    the CPU, 512-token steps."""
    from engine.config import EngineConfig

    kwargs = _engine_kwargs(args)
    if args.role == "prefill":
        kwargs.setdefault("scheduling_policy", "sjf")
        if args.device == "cpu":
            kwargs.setdefault("max_num_batched_tokens", 512)
    return EngineConfig(**kwargs, kv_store_url=args.kv_store_url,
                        kv_load_mode=args.kv_load_mode,
                        kv_layerwise_max_tokens=args.kv_layerwise_max_tokens)


def _run_worker(args: argparse.Namespace) -> int:
    import asyncio

    from kvstore.credentials import TLSFiles, read_secret
    from services.procs import PortInUseError
    from services.secrets import ENGINE_CORE_DROPS, drop_from_environ
    from services.worker.auth import TOKEN_ENV, ExposedWorkerError
    from services.worker.engine_guard import GuardOptions
    from services.worker.server import WorkerOptions, serve

    engine = worker_engine_config(args)
    port = args.port if args.port is not None else (50051 if args.role == "prefill" else 50061)
    guard = GuardOptions(unready_after_s=args.core_unready_s, silence_s=args.core_silence_s,
                         step_timeout_s=args.step_timeout_s, max_restarts=args.max_engine_restarts)
    options = WorkerOptions(role=args.role, engine=engine, host=args.host, port=port, grace_s=args.grace_s,
                            metrics_port=args.metrics_port, heartbeat_s=args.heartbeat_s,
                            reuse_port=args.reuse_port, guard=guard,
                            served_model_name=args.served_model_name, token=read_secret(TOKEN_ENV),
                            tls=TLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca),
                            no_auth=args.no_auth)
    drop_from_environ(ENGINE_CORE_DROPS)  # read: the engine cores it starts do not inherit them
    tracing.setup(f"pdserve-{args.role}", args.otlp_traces_endpoint)
    try:
        return asyncio.run(serve(options))
    except (PortInUseError, ExposedWorkerError) as e:
        print(f"pdserve worker: {e}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()


def _add_tracing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send request traces (OpenTelemetry, OTLP) here, as vLLM's flag; the "
                        "standard OTEL_EXPORTER_OTLP_* variables work too (default: off; "
                        "docs/tracing.md)")


def _add_router(subparsers: Any) -> None:
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
    _add_tracing_arg(p)
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


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate, _add_kvstore, _add_worker, _add_router,
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


if __name__ == "__main__":
    sys.exit(main())
