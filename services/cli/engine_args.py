"""The engine's flags, shared by `pdserve generate` and `pdserve worker`, and the tracing flag
of the long-running components."""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import DEFAULT_MODEL
from engine.kv_events.config import KVEventsConfig
from engine.spec.config import SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
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


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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


def add_tracing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send request traces (OpenTelemetry, OTLP) here, as vLLM's flag; the "
                        "standard OTEL_EXPORTER_OTLP_* variables work too (default: off; "
                        "docs/tracing.md)")
