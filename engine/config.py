"""The engine's one frozen configuration, validated on construction.

Derived values are properties. Values that depend on the model (`max_model_len` when not given)
are resolved once at start-up with `resolved(...)`, which returns a new config.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from engine.kv_events.config import KVEventsConfig
from engine.spec.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_DTYPE_ENV = "PDSERVE_AUTO_DTYPE"  # what "auto" means on this host, when set
_POLICIES = ("fcfs", "priority", "sjf")
_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine (one model, one KV cache).

    `dtype` is the weights', activations' and KV cache's type. "auto" (the default) is bfloat16
    on CUDA and on CPUs with AVX-512 BF16 or AMX (whose GEMMs run bf16 about twice as fast as
    float32 through oneDNN), float32 on other CPUs; PDSERVE_AUTO_DTYPE=float32 (or bfloat16)
    overrides that choice for a host. It is resolved on construction: `config.dtype` is never
    "auto". float32 is the one that equals transformers token for token.
    KV cache size: `num_kv_blocks` when given, else `kv_cache_gib` GiB of cache memory, else
    the default (engine/kv_cache_sizing.py): on the CPU, PDSERVE_CPU_KVCACHE_SPACE GiB when set,
    else `cpu_kv_cache_share` of the memory available at start divided among the host's
    `kv_cache_sharers` engines; on CUDA, what `gpu_memory_utilization` of the GPU's memory leaves
    after the weights and a profiled peak step (as vLLM sizes it).
    On CUDA, decode steps run as captured CUDA graphs unless `enforce_eager`.
    `attention_backend` "auto" picks Triton on CUDA and PyTorch on the CPU; "triton" on the CPU
    runs the Triton kernels in Triton's interpreter (needs TRITON_INTERPRET=1; for tests).
    `max_num_batched_tokens` is the token budget of one step; prefills longer than the budget
    are chunked. `long_prefill_token_threshold` (0 = off) caps the tokens one prefill may take
    in one step so that long prompts do not starve decodes.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: Dtype = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gib: float | None = None
    cpu_kv_cache_share: float = 0.5
    kv_cache_sharers: int = 1
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # KV connector (disaggregated prefill/decode and cross-instance reuse through the KV store)
    kv_connector: Literal["kvstore"] | None = None
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_store_url: str = "grpc://127.0.0.1:50071"
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    kv_chunk_size: int = 256
    kv_lease_s: float = 60.0
    # Every KV store call's limit (lookups, leases and releases, which the scheduler makes beside
    # the engine's loop: kv_store_control_timeout_s); a store that timed out or was unreachable
    # is then left alone for kv_store_timeout_s (the connector recomputes meanwhile). No step
    # waits on the store long: at most kv_save_wait_s for its saves (later ones go on in the
    # background; a consumer that misses them recomputes), at most kv_load_wait_s for its
    # layer-wise loads (then they fail and their requests recompute), and lookups not at all
    # beyond 50 ms (their requests wait meanwhile); a store that failed is not waited for at all
    # for kv_store_timeout_s after.
    kv_store_timeout_s: float = 10.0
    kv_store_control_timeout_s: float = 1.0
    kv_save_wait_s: float = 5.0
    kv_load_wait_s: float = 0.5
    # A request that awaits its prefill's first token (an early hand-off) loads the prompt's KV
    # as its producer saves it: objects not in the store yet are asked for again every
    # kv_await_poll_s (longer while none come) for as long as the request waits; the first
    # token makes it ask at once for the last ones, and what is still missing kv_await_s after
    # the token is recomputed. Seldom asking keeps the polls' CPU off the prefill that shares
    # the host (every poll is a store round trip); what a prefill saved since the last poll is
    # loaded after its token came.
    kv_await_s: float = 1.0
    kv_await_poll_s: float = 0.05
    # "async": the request waits in WAITING_FOR_REMOTE_KVS while its KV loads, others run (it
    # joins the step after the one its load finished in);
    # "layerwise": loaded inside the step that computes the rest, each layer waited for in turn
    # (one step sooner for the request, that step longer by the load for the others);
    # "auto": layer-wise for loads of at most kv_layerwise_max_tokens tokens, async above.
    kv_load_mode: Literal["auto", "async", "layerwise"] = "auto"
    kv_layerwise_max_tokens: int = 2048
    kv_stream_layers: bool = True  # False: send a step's KV after its last layer (for comparison)
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    # A hybrid model's (Gemma 2/3) windowed layers free the blocks their window has left, in KV
    # cache groups of their own (engine/core/kv_layout.py); True: one group, every block kept
    # (vLLM's --disable-hybrid-kv-cache-manager). Models whose every layer has a window free
    # theirs either way.
    disable_hybrid_kv_cache_manager: bool = False
    max_model_len: int | None = None
    # "sjf": fewest tokens left first, for waiting requests and for chunked prefills under way
    # (a long prefill's next chunk waits while a shorter prompt is queued); a request waiting
    # `sjf_max_wait_s` since arrival goes ahead of younger ones. Meant for prefill workers.
    scheduling_policy: Literal["fcfs", "priority", "sjf"] = "fcfs"
    sjf_max_wait_s: float = 10.0
    seed: int = 0
    num_threads: int | None = None  # under tensor parallelism: per rank (default: cores / ranks)
    # Tensor parallelism (engine/parallel/): the model split over this many processes on this
    # host (gloo on the CPU), one rank each. `tp_timeout_s`: how long a rank waits for the others
    # in a collective (a rank that hangs fails the step after it, and the engine restarts).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    # Structured outputs: "auto" picks xgrammar, else llguidance for what xgrammar cannot compile
    # (as vLLM); "xgrammar" / "guidance" use only that one.
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = "auto"
    # Speculative decoding (engine/spec/): vLLM's speculative_config, as a SpeculativeConfig or
    # its dict / JSON form (parsed here); None = off.
    speculative_config: SpeculativeConfig | None = None
    # KV cache events (engine/kv_events/): vLLM's kv_events_config, as a KVEventsConfig or its
    # dict / JSON form; None = off.
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        _check(bool(self.model), "model", "must be a model name or path")
        _check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               f"must be a power of two in [1, 128], got {self.block_size}")
        _check(0 < self.cpu_kv_cache_share <= 0.95, "cpu_kv_cache_share",
               f"must be in (0, 0.95], got {self.cpu_kv_cache_share}")
        _check(self.kv_cache_sharers >= 1, "kv_cache_sharers",
               f"must be at least 1, got {self.kv_cache_sharers}")
        if self.kv_cache_gib is not None:
            _check(self.kv_cache_gib > 0, "kv_cache_gib", f"must be positive, got {self.kv_cache_gib}")
        _check(self.kv_connector in (None, "kvstore"), "kv_connector",
               f"must be None or 'kvstore', got {self.kv_connector!r}")
        _check(self.kv_role in ("kv_producer", "kv_consumer", "kv_both"), "kv_role",
               f"must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}")
        _check(self.kv_load_failure_policy in ("recompute", "fail"), "kv_load_failure_policy",
               f"must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}")
        _check(self.kv_chunk_size >= 1 and self.kv_chunk_size % self.block_size == 0,
               "kv_chunk_size", f"must be a positive multiple of block_size, got {self.kv_chunk_size}")
        _check(self.kv_load_mode in ("auto", "async", "layerwise"), "kv_load_mode",
               f"must be 'auto', 'async' or 'layerwise', got {self.kv_load_mode!r}")
        _check(self.kv_layerwise_max_tokens >= 0, "kv_layerwise_max_tokens",
               f"must be non-negative, got {self.kv_layerwise_max_tokens}")
        _check(self.kv_lease_s > 0, "kv_lease_s", f"must be positive, got {self.kv_lease_s}")
        _check(self.kv_store_timeout_s > 0, "kv_store_timeout_s",
               f"must be positive, got {self.kv_store_timeout_s}")
        _check(self.kv_save_wait_s > 0, "kv_save_wait_s", f"must be positive, got {self.kv_save_wait_s}")
        _check(self.kv_load_wait_s > 0, "kv_load_wait_s", f"must be positive, got {self.kv_load_wait_s}")
        _check(self.kv_await_s > 0, "kv_await_s", f"must be positive, got {self.kv_await_s}")
        _check(0 < self.kv_await_poll_s <= 1, "kv_await_poll_s",
               f"must be in (0, 1], got {self.kv_await_poll_s}")
        _check(self.kv_store_control_timeout_s > 0, "kv_store_control_timeout_s",
               f"must be positive, got {self.kv_store_control_timeout_s}")
        _check(self.attention_backend in _BACKENDS, "attention_backend",
               f"must be one of {_BACKENDS}, got {self.attention_backend!r}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None:
            _check(self.num_kv_blocks >= 2, "num_kv_blocks",
                   f"must be at least 2 (one is the null block), got {self.num_kv_blocks}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be at least 1, got {self.max_num_batched_tokens}")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               f"must be non-negative, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None:
            _check(self.max_model_len >= 1, "max_model_len",
                   f"must be at least 1, got {self.max_model_len}")
        _check(self.scheduling_policy in _POLICIES, "scheduling_policy",
               f"must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        _check(self.sjf_max_wait_s > 0, "sjf_max_wait_s",
               f"must be positive, got {self.sjf_max_wait_s}")
        _check(self.structured_outputs_backend in ("auto", "xgrammar", "guidance"),
               "structured_outputs_backend", f"must be auto, xgrammar or guidance, got "
               f"{self.structured_outputs_backend!r}")
        if self.num_threads is not None:
            _check(self.num_threads >= 1, "num_threads", f"must be at least 1, got {self.num_threads}")
        _check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size",
               f"must be in [1, 64], got {self.tensor_parallel_size}")
        _check(self.tp_timeout_s > 0, "tp_timeout_s", f"must be positive, got {self.tp_timeout_s}")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            _check(self.tensor_parallel_size == 1, "speculative_config.method",
                   "draft_model runs with tensor_parallel_size 1 in this version")
        if self.tensor_parallel_size > 1:
            _check(self.device == "cpu", "tensor_parallel_size",
                   "more than 1 runs on the CPU (gloo) in this version; the CUDA path (nccl, one "
                   "GPU a rank) is not built yet")

    def resolved(self, model_max_len: int) -> EngineConfig:
        """This config with `max_model_len` fixed against the model's own limit."""
        if self.max_model_len is None:
            return replace(self, max_model_len=model_max_len)
        _check(self.max_model_len <= model_max_len, "max_model_len",
               f"must be at most the model's limit {model_max_len}, got {self.max_model_len}")
        return self

    @property
    def model_len(self) -> int:
        """`max_model_len`, which must have been resolved."""
        if self.max_model_len is None:
            raise RuntimeError("max_model_len is not resolved yet; call resolved() first")
        return self.max_model_len


def auto_dtype(device: str) -> Literal["float32", "bfloat16", "float16"]:
    """What dtype "auto" means for `device` on this host (see EngineConfig)."""
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        _check(forced in _DTYPES[1:], AUTO_DTYPE_ENV,
               f"must be one of {_DTYPES[1:]}, got {forced!r}")
        return forced  # type: ignore[return-value]
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX-BF16): /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {message}")
