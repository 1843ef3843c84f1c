"""Streaming generation for servers (vLLM's `AsyncLLM`).

Requests may be added at any time while others run (continuous batching happens in the core).
A background task pulls core outputs, turns them into RequestOutputs and hands each to its
request's collector; `generate()` yields from that collector per the request's output_kind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

from engine.config import EngineConfig
from engine.core.outputs import EngineStats, FirstToken
from engine.core_client import AsyncMPClient, EngineCoreClient, EngineDeadError, InprocClient
from engine.output_processor import OutputProcessor, RequestOutputCollector
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType, prompt_cache_salt
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """An engine for asyncio servers; the core runs in a child process unless `multiprocess=False`."""

    def __init__(self, config: EngineConfig, multiprocess: bool = True) -> None:
        from engine.model.loader import load_tokenizer, resolve_model_path

        # The core first: it resolves (and caches) the model before the tokenizer is read here.
        self.engine_core: EngineCoreClient = (
            AsyncMPClient(config) if multiprocess else InprocClient(config))
        self.config = self.engine_core.config
        self.tokenizer = load_tokenizer(resolve_model_path(self.config.tokenizer or self.config.model))
        from engine.model.loader import model_eos_token_ids

        self.processor = Processor(self.config, self.tokenizer, self.engine_core.vocab_size,
                                   model_eos_token_ids(resolve_model_path(self.config.model)))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._output_handler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True) -> AsyncLLM:
        return cls(config, multiprocess=multiprocess)

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def core_problem(self, silence_s: float, step_timeout_s: float) -> str | None:
        """Why the engine core cannot serve, or None: it died, it has been silent (frozen,
        stopped, or its process stuck) for `silence_s`, or one step has run `step_timeout_s`."""
        if self._dead is not None:
            return str(self._dead)
        live = self.engine_core.liveness()
        if live is None:
            return None
        if live.silent_s > silence_s:
            return f"engine core silent for {live.silent_s:.1f} s (frozen or stuck)"
        if live.step_s > step_timeout_s:
            return f"an engine step has run for {live.step_s:.1f} s (stuck)"
        return None

    def fail(self, reason: str) -> None:
        """Ends an engine whose core no longer serves: the core process is killed and every
        request waiting on it fails with EngineDeadError(reason) now (its consumers do not wait
        for the death to be noticed)."""
        self.engine_core.kill()
        if self._dead is None:
            self._dead = EngineDeadError(reason)
            self.output_processor.propagate_error(self._dead)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        on_added: Callable[[], Awaitable[None]] | None = None,
        num_prior_outputs: int = 0,
        await_first_token: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs; the last one has `finished=True`.

        Raises ValueError for bad input (other requests keep running) and EngineDeadError when
        the core died. A consumer that stops early aborts the request in the core. `on_added` is
        awaited once the core has the request, before its first output (a server tells its
        client there that the request was accepted). `num_prior_outputs`: the prompt's last
        that many tokens are earlier outputs of this (single) sample, which the engine continues
        (EngineCoreRequest.num_prior_outputs); outputs carry only the new tokens. A prompt
        dict's `cache_salt` keeps its KV apart from other salts' (EngineCoreRequest.cache_salt).
        `await_first_token`: an early hand-off (EngineCoreRequest.await_first_token); nothing
        is computed before `add_first_token` gives the prefill's first token.
        """
        if self._dead is not None:
            raise self._dead
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, token_ids = self.processor.preprocess(prompt)
        requests = self.processor.make_requests(request_id, token_ids, params, priority=priority,
                                                num_prior_outputs=num_prior_outputs,
                                                cache_salt=prompt_cache_salt(prompt),
                                                await_first_token=await_first_token)
        collector = RequestOutputCollector(params.output_kind)
        self.output_processor.add_request(request_id, text, requests, params, collector)
        self._ensure_output_handler()
        try:
            for request in requests:
                await self.engine_core.add_request_async(request)
        except BaseException:
            self.abort_nowait(request_id)
            raise
        finished = False
        try:
            if on_added is not None:
                await on_added()
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except BaseException:  # cancelled, closed early, or on_added failed: the core lets go too
            if not finished:
                self.abort_nowait(request_id)
            raise

    async def add_first_token(self, request_id: str, token_id: int,
                              kv_transfer_params: dict[str, Any] | None = None) -> None:
        """The prefill's first token of a request generated with await_first_token, and the
        producer's kv_transfer_params; ignored for one that is not waiting for it."""
        if self._dead is not None:
            raise self._dead
        await self.engine_core.add_first_token_async(FirstToken(request_id, token_id, kv_transfer_params))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Ends requests; their consumers get a last output with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self.output_processor.abort_requests(ids)
        if core_ids and self._dead is None:
            await self.engine_core.abort_requests_async(core_ids)

    async def get_stats(self) -> EngineStats:
        return await self.engine_core.get_stats_async()

    def shutdown(self) -> None:
        """Stops the output handler and the core (its process, when it has one). Call it from
        the event loop's thread, or with no loop running; `close()` is the async form."""
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        self.engine_core.shutdown()

    async def close(self) -> None:
        """`shutdown` from a coroutine: the core's blocking shutdown runs in a thread."""
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        await asyncio.to_thread(self.engine_core.shutdown)

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process_outputs(outputs.outputs)
                if processed.reqs_to_abort:
                    await self.engine_core.abort_requests_async(processed.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine failed: {e!r}")
            logger.error("output handler stopped: %s", dead)
            self._dead = dead
            self.output_processor.propagate_error(dead)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` without awaiting: the request's output ends now, the core is told by a task
        (for a generator being closed, which must not await)."""
        core_ids = self.output_processor.abort_requests([request_id])
        if not core_ids or self._dead is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalized outside the event loop
            self.engine_core.abort_requests(core_ids)
            return
        task = loop.create_task(self.engine_core.abort_requests_async(core_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
