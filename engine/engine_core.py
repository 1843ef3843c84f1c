"""EngineCore: the scheduler and the model runner, stepped together (vLLM's EngineCore).

Token ids in, token ids out. It runs in the caller's process (InprocClient) or in a process of
its own behind ZMQ (engine/core_proc.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.connector.keys import ForeignKeys, key_scheme
from engine.connector.transfer_params import check_transfer_params
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import (
    STEP_SECONDS_BUCKETS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FirstToken,
    Histogram,
)
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.kv_cache_sizing import (
    check_cache_holds_one_request,
    cpu_available_bytes,
    engine_kv_blocks,
    fit_model_len,
    kv_layout,
)
from engine.spec.decoder import SpecDecoder, draft_proposer
from engine.structured.backends import Matcher, XgrammarMatcher
from engine.structured.bitmask import GrammarBitmask
from engine.structured.draft_rows import draft_rows
from engine.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from engine.kv_events.publisher import ZmqEventPublisher
    from engine.parallel.executor import TPExecutor

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    """One model, one KV cache, one scheduler. Not thread-safe: one caller steps it."""

    def __init__(self, config: EngineConfig) -> None:
        self.last_step_idle = False
        self.idle_wait_s = 0.001
        self.tp_executor: TPExecutor | None = None
        if config.tensor_parallel_size > 1:
            from engine.model.loader import load_config, resolve_model_path
            from engine.model.models import options_for
            from engine.parallel.executor import TPExecutor
            from engine.parallel.shard import Shard

            # a model the ranks cannot split is refused before any rank starts
            Shard(options_for(load_config(resolve_model_path(config.model))), 0, config.tensor_parallel_size)
            # the other ranks start first (they load their shards while this one loads its own)
            self.tp_executor = TPExecutor(config)
            torch.set_num_threads(TPExecutor.threads(config))
        elif config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        try:
            self._build(config)
        except BaseException:
            if self.tp_executor is not None:
                self.tp_executor.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        from engine.attention.selector import backend_for_device
        from engine.model.loader import (
            load_model,
            model_eos_token_ids,
            model_max_len,
            resolve_model_path,
        )
        from engine.runner import ModelRunner

        torch.manual_seed(config.seed)
        dtype = DTYPES[config.dtype]
        device = torch.device(config.device)
        backend = backend_for_device(device, config.attention_backend)
        free_before_load = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                            else cpu_available_bytes())
        path = resolve_model_path(config.model)
        executor = self.tp_executor
        model, hf_config = load_model(path, dtype, backend, device,
                                      None if executor is None else executor.tp)
        chosen_len = config.max_model_len
        config = config.resolved(model_max_len(hf_config))
        layout = kv_layout(model, config)
        num_blocks = engine_kv_blocks(config, model, layout, dtype, device, free_before_load)
        if chosen_len is None:  # the model's limit, unless the cache cannot hold one request of it
            config = fit_model_len(config, num_blocks, layout, model_max_len(hf_config))
        check_cache_holds_one_request(config, num_blocks, layout)
        self.kv_layout = layout
        self.config = config
        self.model_path = path
        self.vocab_size: int = model.vocab_size
        # Every eos id of the model (Gemma's <end_of_turn>, Llama 3's <|eot_id|>, ...)
        self.eos_token_ids = model_eos_token_ids(path)
        self.num_blocks = num_blocks
        self.runner = ModelRunner(
            model, config.block_size, num_blocks, config.max_num_seqs, config.model_len,
            config.max_num_batched_tokens, dtype, device, eos_token_id_of(hf_config), config.seed,
            layout)
        spec = config.speculative_config
        if spec is not None:
            draft = None if spec.model is None else draft_proposer(
                spec.model, model.vocab_size, backend, config, num_blocks, dtype, device)
            self.runner.spec = SpecDecoder(spec, config.model_len, draft)
        if device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs)
        # every rank's cache (rank 0's connector moves them all); the other ranks build theirs
        rank_caches = [self.runner.kv_caches] if executor is None else executor.start(
            self.runner, config.model_len)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size,
                                               config.enable_prefix_caching,
                                               group_windows=layout.windows)
        self.kv_events: ZmqEventPublisher | None = None
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self.step_seconds = Histogram.with_bounds(STEP_SECONDS_BUCKETS)  # steps that computed tokens
        self.fill_in_thread = device.type != "cpu"  # grammar bitmasks (see _grammar_bitmask)
        self.check_unmasked = device.type == "cpu"  # argmax rows masked only when needed (same)
        # Grammars compile in the manager's threads; its tokenizer loads with the first one.
        self.structured = StructuredOutputManager(
            str(resolve_model_path(config.tokenizer) if config.tokenizer else path), model.vocab_size,
            eos_token_id_of(hf_config), config.structured_outputs_backend)
        if config.kv_connector is not None:
            from engine.connector.factory import make_kvstore_connector

            sched_half, worker_half = make_kvstore_connector(config, model.num_layers)
            self.scheduler.connector = sched_half
            full = model.shard.full if model.shard is not None else model.opts
            worker_half.register_rank_caches(rank_caches, full.num_kv_heads)
            self.runner.set_connector(worker_half)
        self.kv_events = self._kv_events_publisher(config, layout.num_groups, device)
        logger.info("engine core ready: %s on %s (%s attention), %d KV blocks of %d tokens "
                    "(%d KV cache group(s) of %d layers), max_model_len %d", path, device,
                    backend.name, num_blocks - 1, config.block_size, layout.num_groups,
                    layout.layers_per_block, config.model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request; raises ValueError naming the field when it cannot be served."""
        self._validate(request)
        params = request.sampling_params
        extra = [t for t in self.eos_token_ids if t != request.eos_token_id]
        if extra and not params.ignore_eos:  # as vLLM: the other eos ids stop like stop ids
            stops = list(dict.fromkeys([*params.stop_token_ids, *extra]))
            if stops != params.stop_token_ids:
                request = replace(request, sampling_params=replace(params, stop_token_ids=stops))
        core_request = Request.from_engine_core_request(request)
        if request.sampling_params.structured_outputs is not None:
            core_request.grammar = self.structured.start(request.sampling_params.structured_outputs)
        self.scheduler.add_request(core_request)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """`wakeup()` is called (from another thread) when a KV load finishes, so a loop that
        waits for input between idle steps steps again at once."""
        connector = self.runner.connector
        if connector is not None:
            connector.set_wakeup(wakeup)

    def add_first_token(self, first: FirstToken) -> None:
        """The prefill's first token of a request added with await_first_token (the edge
        checked it); ignored for a request that is not waiting for one (ended, aborted)."""
        if not 0 <= first.token_id < self.vocab_size:
            logger.warning("first token %d of %s is out of range; ignored", first.token_id,
                           first.request_id)
            return
        if not self.scheduler.add_first_token(first.request_id, first.token_id,
                                              first.kv_transfer_params):
            logger.info("first token for %s, which awaits none (ended?): ignored", first.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends the requests and frees their blocks; emits no output for them."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self, idle_sleep_s: float = 0.001) -> EngineCoreOutputs:
        """One step. A step that scheduled nothing and gave nothing (only KV loads in flight or
        grammars compiling) sleeps `idle_sleep_s` so a caller's loop does not spin, and sets
        `last_step_idle` and `idle_wait_s`, how long such a caller may wait for input before
        stepping again (a caller that can wait for input passes 0)."""
        self.last_step_idle = False
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        grammar = self._grammar_bitmask(scheduler_output.structured_output_request_ids,
                                        scheduler_output.scheduled_spec_decode_tokens)
        try:
            if self.tp_executor is not None:
                self.tp_executor.before_step(scheduler_output)
            runner_output = self.runner.execute_model(scheduler_output, grammar)
            if self.tp_executor is not None:
                self.tp_executor.after_step(runner_output)
        finally:
            if grammar is not None:
                grammar.settle()  # the fill thread is done with the matchers before they advance
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.kv_events is not None:
            self._flush_kv_events()
        if scheduler_output.num_scheduled_tokens:
            self.step_seconds.observe(time.perf_counter() - start)
        elif not outputs.outputs and not _finished_loads(runner_output):
            self.last_step_idle = True  # (a load that finished lets its request run next step)
            # Only loads in flight (which wake the caller when they finish): a longer wait; a
            # grammar compiling or a store lookup unanswered: soon again.
            only_loads = not self.scheduler.waiting_for_fsm and len(self.scheduler.waiting) == 0
            self.idle_wait_s = 0.01 if only_loads else 0.001
            if idle_sleep_s > 0:
                time.sleep(idle_sleep_s)  # only KV loads in flight or grammars compiling: no spin
        return outputs

    def _grammar_bitmask(self, req_ids: list[str],
                         drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The bitmask rows of this step's constrained samplers (one pass over their matchers).
        On a GPU they are filled in the manager's fill thread while the forward runs on the
        device. On CPU they are filled here, before the forward, with the additive mask the
        runner adds to the logits: the forward's threads use every core, and a fill thread
        beside them stalls each of their parallel regions (measured: 16 JSON-schema rows cost
        the step 15.5 ms overlapped, against ~6.5 ms of fill done first). On CPU, the rows an
        argmax samples (`_checkable`) are not filled here at all: the sampler checks their
        unmasked choice and a row is filled only when its grammar refuses it (ArgmaxCheck;
        3 greedy rows in 4 of the structured benchmark's need no mask). A request with drafts
        gets a row per drafted position (engine/structured/draft_rows.py), filled here."""
        if not req_ids:
            return None
        on_cpu = self.runner.device.type == "cpu"
        requests = self.scheduler.requests
        if drafts and any(r in drafts for r in req_ids):
            return draft_rows(self.structured, req_ids, self._matchers(req_ids), drafts, on_cpu)
        filled: list[str] = []
        checked: list[str] = []
        for req_id in req_ids:
            (checked if self._checkable(requests[req_id]) else filled).append(req_id)
        pending = None
        if filled:
            pending = self.structured.fill(self._matchers(filled), additive=on_cpu,
                                           in_thread=self.fill_in_thread)
        check = None
        if checked:
            matchers = [m for m in self._matchers(checked) if isinstance(m, XgrammarMatcher)]
            assert len(matchers) == len(checked)  # (_checkable)
            check = self.structured.argmax_check(
                checked, [requests[r].sampling_params.is_greedy for r in checked], matchers)
        return GrammarBitmask(filled, pending, check)

    def _checkable(self, request: Request) -> bool:
        """Whether the request's grammar may be checked after its argmax instead of masking
        first (see engine/structured/bitmask.py): on CPU, an xgrammar matcher, no logprobs (they
        come from the constrained distribution), and greedy, or sampled without top-k, top-p
        and min-p (which look at the whole, constrained, row)."""
        params = request.sampling_params
        grammar = request.grammar
        if not (self.check_unmasked and params.logprobs is None and grammar is not None
                and isinstance(grammar.matcher, XgrammarMatcher)):
            return False
        return params.is_greedy or (params.top_p >= 1.0 and params.min_p <= 0.0
                                    and not 1 <= params.top_k < self.vocab_size)

    def _matchers(self, req_ids: list[str]) -> list[Matcher]:
        matchers = []
        for req_id in req_ids:
            grammar = self.scheduler.requests[req_id].grammar
            assert grammar is not None and grammar.matcher is not None
            matchers.append(grammar.matcher)
        return matchers

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """A snapshot (nothing in it changes when the core steps on)."""
        kv = self.kv_cache_manager
        counters = self.scheduler.counters
        connector = self.runner.connector
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=self.num_blocks - 1,
            kv_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            block_size=self.config.block_size,
            block_layer_share=self.kv_layout.layers_per_block / len(self.kv_layout.layer_group),
            max_model_len=self.config.model_len,
            num_cached_blocks=kv.num_prefix_cached_blocks,
            num_prompt_tokens=counters.prompt_tokens,
            num_generation_tokens=counters.generation_tokens,
            num_preemptions=counters.preemptions,
            step_seconds=self.step_seconds.copy(),
            kv_transfer=connector.get_transfer_stats() if connector is not None else None,
            requests=counters.histograms.copy(),
            spec_decoding=None if self.scheduler.spec_stats is None else self.scheduler.spec_stats.copy(),
            **self._kv_events_stats(),
        )

    def reset_prefix_cache(self) -> bool:
        done = self.kv_cache_manager.reset_prefix_cache()
        if self.kv_events is not None:
            self._flush_kv_events()
        return done

    def _kv_events_stats(self) -> dict[str, Any]:
        events = self.kv_events
        if events is None:
            return {}
        return dict(kv_events_published=events.next_seq, kv_events_endpoint=events.endpoint,
                    kv_events_replay_endpoint=events.replay_endpoint,
                    kv_events_topic=events.config.topic, kv_events_epoch=events.epoch)

    def _flush_kv_events(self) -> None:
        recorder = self.kv_cache_manager.block_pool.recorder
        if self.kv_events is not None and recorder is not None:
            self.kv_events.publish(recorder.take())

    def _kv_events_publisher(self, config: EngineConfig, num_groups: int,
                             device: torch.device) -> ZmqEventPublisher | None:
        """vLLM's KV cache events, when configured: every hash that enters or leaves the prefix
        cache, published after each step (engine/kv_events/)."""
        events = config.kv_events_config
        if events is None or not events.publishing or not config.enable_prefix_caching:
            return None
        from engine.kv_events.events import AllBlocksCleared
        from engine.kv_events.publisher import ZmqEventPublisher
        from engine.kv_events.recorder import KVEventRecorder

        medium = "GPU" if device.type == "cuda" else "CPU"
        recorder = KVEventRecorder(config.block_size, num_groups, medium)
        self.kv_cache_manager.block_pool.recorder = recorder
        publisher = ZmqEventPublisher(events)
        # the cache starts empty: a subscriber that sees this first batch forgets what it knew
        publisher.publish([AllBlocksCleared()])
        return publisher

    def shutdown(self) -> None:
        self.abort_requests(list(self.scheduler.requests))
        self.structured.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        if self.runner.connector is not None:
            self.runner.connector.shutdown()
        if self.tp_executor is not None:
            self.tp_executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def _validate(self, request: EngineCoreRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n > self.config.model_len:
            raise ValueError(f"prompt has {n} tokens, longer than max_model_len="
                             f"{self.config.model_len}")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        if not 0 <= request.num_prior_outputs < n:
            raise ValueError(f"num_prior_outputs must be in [0, {n}) (at least one prompt token), "
                             f"got {request.num_prior_outputs}")
        request.sampling_params.check_vocab(self.vocab_size)
        if request.await_first_token:
            _check_awaits_first_token(request)
        if request.sampling_params.n != 1:
            raise ValueError("sampling_params.n must be 1 in the engine core; the front end "
                             "fans out n > 1")
        params = request.sampling_params.kv_transfer_params
        check_transfer_params(params, n, self.config.kv_chunk_size)
        if params and params.get("do_remote_prefill"):
            with contextlib.suppress(ForeignKeys):  # another engine's: none loads here (recomputed)
                key_scheme(self.config).check_keys(params.get("keys", []), request.prompt_token_ids[
                    :params.get("num_tokens", 0)], request.cache_salt)


def _finished_loads(runner_output: Any) -> bool:
    kv = runner_output.kv_connector_output
    return kv is not None and bool(kv.finished_recving)


def _check_awaits_first_token(request: EngineCoreRequest) -> None:
    """An early hand-off names its producer and continues one sample from its first output."""
    params = request.sampling_params.kv_transfer_params or {}
    if not params.get("do_remote_prefill"):
        raise ValueError("await_first_token needs kv_transfer_params with do_remote_prefill (the "
                         "producer whose first token it awaits)")
    if request.num_prior_outputs:
        raise ValueError("await_first_token: num_prior_outputs must be 0 (the first token comes later)")
    if request.sampling_params.structured_outputs is not None:
        raise ValueError("await_first_token: not with structured_outputs (send the decode after "
                         "the prefill)")


def eos_token_id_of(hf_config: object) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos if isinstance(eos, int) else None
