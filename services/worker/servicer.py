"""The worker's gRPC servicer (`pdserve.worker.v1.Worker`; served by services/worker/server.py):
a thin adapter over the engine its guard keeps. It validates, converts (convert.py), and maps
engine errors to status codes; cancelling a call aborts its engine request.

Roles: "prefill" runs its engine as a KV producer and offers Prefill; "decode" runs a KV consumer
and offers Decode; "colocated" has no connector and offers Decode, computing the whole prompt.
Calls fail with UNAVAILABLE while the engine does not serve; Load always answers and says
whether the worker serves, and why not. A Decode stream with nothing new for `heartbeat_s`
gets an empty chunk while the engine core is alive, so a caller can tell a quiet stream from a
stalled worker. A decode worker's Decode with await_first_token (an early hand-off, sent beside
its Prefill) waits for FirstToken before computing anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from engine.async_llm import AsyncLLM
from engine.connector.keys import ForeignKeys, KeyScheme
from engine.connector.transfer_params import check_transfer_params
from engine.core.outputs import EngineStats
from engine.core_client import EngineDeadError
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services import tracing
from services.procs import instance_id
from services.worker import trace_spans
from services.worker.call_end import CallEnd
from services.worker.convert import (
    chunk_from_output,
    kv_params_from_proto,
    kv_params_to_proto,
    params_from_proto,
    position_to_proto,
    prompt_logprobs_to_proto,
    token_ids_from_proto,
)
from services.worker.edge_checks import check_request
from services.worker.engine_guard import EngineGuard
from services.worker.heartbeats import with_heartbeats
from services.worker.options import WorkerRole

_PROTO_ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "colocated": pb.ROLE_COLOCATED}
logger = logging.getLogger(__name__)
# the caller cancelled the call (or the server is stopping): not an error of the call (as in
# OpenTelemetry's gRPC conventions, CANCELLED is no server error)
_CANCELLED = (asyncio.CancelledError, GeneratorExit)
T = TypeVar("T")
LOAD_WAIT_S = 0.2  # how long Load waits for a fresh snapshot before answering with the last one
FIRST_LOAD_WAIT_S = 5.0


class WorkerServicer(pb_grpc.WorkerServicer):
    """Worker RPCs over the engine its guard keeps; UNAVAILABLE while that engine does not serve."""

    def __init__(self, role: WorkerRole, guard: EngineGuard, heartbeat_s: float = 1.0,
                 chunk_size: int = 256, keys: KeyScheme | None = None) -> None:
        self.role = role
        self.guard = guard
        self.heartbeat_s = heartbeat_s
        self.chunk_size = chunk_size  # kv_chunk_size: bounds a Decode's kv_transfer.keys
        # What this worker's engine stores KV under: a Decode's kv_transfer.keys must be its keys
        # of the call's own tokens (KV of another prompt is refused, not loaded).
        self.keys = keys
        self.instance_id = instance_id()
        self._active: set[str] = set()
        self._awaiting: dict[str, tuple[list[int], str]] = {}  # early Decodes: (prompt, cache_salt)
        self._stats: EngineStats | None = None  # the last snapshot Load got
        self._stats_task: asyncio.Future[EngineStats] | None = None
        self._stats_engine: AsyncLLM | None = None  # whose snapshots those are

    @property
    def engine(self) -> AsyncLLM | None:
        return self.guard.engine

    def _keep_stats(self, engine: AsyncLLM, task: asyncio.Future[EngineStats]) -> None:
        if engine is self._stats_engine and not task.cancelled() and task.exception() is None:
            self._stats = task.result()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrefillResponse:
        if self.role != "prefill":
            await _fail(context, grpc.StatusCode.UNIMPLEMENTED, f"a {self.role} worker does not prefill")
        # The sample's own limits ride along for metrics: its first token may end it here.
        transfer = {"do_remote_decode": True, "transfer_id": request.transfer_id or request.request_id,
                    "sample_max_tokens": request.params.max_tokens or None,
                    "sample_min_tokens": request.params.min_tokens}
        one_token = pb.SamplingParams()
        one_token.CopyFrom(request.params)
        one_token.max_tokens, one_token.min_tokens = 1, min(one_token.min_tokens, 1)

        def parse() -> tuple[list[int], SamplingParams]:
            ids = token_ids_from_proto(request.token_ids)
            check_transfer_params(transfer, len(ids), self.chunk_size)
            return ids, params_from_proto(one_token, RequestOutputKind.FINAL_ONLY, transfer)

        ids, params = await _parse(context, parse)
        final: RequestOutput | None = None
        started, error, cancelled = time.time(), None, False
        try:
            async for out in self._generate(context, request.request_id, ids, params, request.priority,
                                            cache_salt=request.cache_salt):
                final = out
        except _CANCELLED:
            cancelled = True
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            if tracing.tracer() is not None:
                if error is None and not cancelled and (
                        final is None or not final.outputs or not final.outputs[0].token_ids):
                    error = "ended before its first token"
                self._trace("prefill", context, started, request.request_id, final, error, len(ids),
                            **{"pdserve.cancelled": cancelled})
        assert final is not None and final.finished
        sample = final.outputs[0]
        if not sample.token_ids:  # aborted before its first token (Abort, or a KV store failure)
            await _fail(context, grpc.StatusCode.ABORTED, f"prefill ended: {sample.stop_reason or 'abort'}")
        first = sample.token_ids[0]
        finish = sample.finish_reason or ""
        if finish == "length" and self._ends_request(first, params, request.params.min_tokens):
            finish = "stop"  # the first token ends it: no decode follows
        reply = pb.PrefillResponse(first_token_id=first, finish_reason=finish,
                                   kv_transfer=kv_params_to_proto(final.kv_transfer_params),
                                   num_cached_tokens=final.num_cached_tokens or 0)
        if sample.logprobs:
            reply.first_logprobs.CopyFrom(position_to_proto(sample.logprobs[0]))
        reply.prompt_logprobs.extend(prompt_logprobs_to_proto(final.prompt_logprobs))
        return reply

    def _ends_request(self, token: int, params: SamplingParams, min_tokens: int) -> bool:
        """Whether `token` as the first output stops the request: the engine reports "length" for
        it (prefill runs with max_tokens 1 and length is checked first, as in vLLM), but the
        request the router will continue must end here when it is EOS (any of the model's eos
        ids: the engine stops on them too) or a stop token id."""
        if min_tokens > 1:
            return False
        processor = self.engine.processor if self.engine is not None else None
        eos = {processor.eos_token_id, *processor.extra_eos_token_ids} if processor else set()
        return token in params.stop_token_ids or (not params.ignore_eos and token in eos)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.DecodeChunk]:
        if self.role == "prefill":
            await _fail(context, grpc.StatusCode.UNIMPLEMENTED, "a prefill worker does not decode")

        def parse() -> tuple[list[int], SamplingParams]:
            ids = token_ids_from_proto(request.token_ids)
            kv = (kv_params_from_proto(request.kv_transfer, len(ids), self.chunk_size)
                  if self.role == "decode" and request.HasField("kv_transfer") else None)
            if request.await_first_token:
                _check_early(self.role, kv, len(ids), request.num_output_tokens)
            if kv is not None and self.keys is not None and kv["keys"]:  # KV of these tokens only
                try:
                    self.keys.check_keys(kv["keys"], ids[:kv["num_tokens"]], request.cache_salt or None)
                except ForeignKeys as e:  # a producer configured otherwise: compute the prompt here
                    logger.warning("decode %s: %s; computing the prompt here", request.request_id, e)
                    kv = None
            return ids, params_from_proto(request.params, RequestOutputKind.DELTA, kv)

        ids, params = await _parse(context, parse)
        completion_tokens = 0
        early = request.await_first_token
        started, error, final, cancelled = time.time(), None, None, False
        outputs = self._generate(context, request.request_id, ids, params, request.priority,
                                 request.num_output_tokens, request.cache_salt,
                                 (ids, request.cache_salt) if early else None)
        chunks = with_heartbeats(outputs, self.heartbeat_s, lambda: self.guard.core_alive(self.heartbeat_s))

        def ended(was_cancelled: bool) -> None:
            if early:
                self._awaiting.pop(request.request_id, None)
            if tracing.tracer() is not None:
                self._trace("decode", context, started, request.request_id, final, error, len(ids),
                            **{"pdserve.kv_from_store": request.HasField("kv_transfer"),
                               "pdserve.cancelled": was_cancelled})

        end = CallEnd(context, chunks, ended)
        try:
            async for out in chunks:
                if out is None:  # nothing new for a while, the engine alive: tell the caller
                    yield pb.DecodeChunk()
                    continue
                sample = out.outputs[0]
                completion_tokens += len(sample.token_ids)
                if not sample.token_ids and not out.finished:
                    continue
                chunk = chunk_from_output(sample, out.prompt_logprobs)
                if out.finished:
                    final = out
                    chunk.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                  cached_tokens=out.num_cached_tokens or 0))
                    end.end(cancelled=False)  # done: a caller closing the stream on this chunk ends nothing
                yield chunk
        except _CANCELLED:
            cancelled = True
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            end.end(cancelled)

    def _trace(self, call: str, context: grpc.aio.ServicerContext, started: float, request_id: str,
               final: RequestOutput | None, error: str | None, prompt_tokens: int,
               **attributes: Any) -> None:
        tracer = tracing.tracer()
        if tracer is None:
            return
        parent = tracing.context_from_metadata(context.invocation_metadata())
        trace_spans.record(tracer, self.role, call, parent, started, request_id,
                           final.metrics if final is not None else None, error,
                           {"gen_ai.usage.input_tokens": prompt_tokens, **attributes})

    async def FirstToken(self, request: pb.FirstTokenRequest, context: grpc.aio.ServicerContext
                         ) -> pb.FirstTokenResponse:
        """The prefill's first token for an early Decode (found=False when none awaits it)."""
        if self.role != "decode":
            await _fail(context, grpc.StatusCode.UNIMPLEMENTED, f"a {self.role} worker has no early decodes")
        engine = await self._engine(context)
        awaiting = self._awaiting.pop(request.request_id, None)
        if awaiting is None:
            return pb.FirstTokenResponse(found=False)
        ids, salt = awaiting

        def parse() -> dict[str, Any] | None:
            if not 0 <= request.first_token_id < engine.processor.vocab_size:
                raise ValueError(f"first_token_id: {request.first_token_id} is out of range "
                                 f"[0, {engine.processor.vocab_size})")
            kv = (kv_params_from_proto(request.kv_transfer, len(ids), self.chunk_size)
                  if request.HasField("kv_transfer") else None)
            if kv is not None and self.keys is not None:
                try:
                    self.keys.check_keys(kv["keys"], ids[:kv["num_tokens"]], salt or None)
                except ForeignKeys as e:  # it loaded under its own keys; the lease just expires
                    logger.warning("first token of %s: %s", request.request_id, e)
                    kv = None
            return kv

        try:
            kv = parse()
        except ValueError as e:
            self._awaiting[request.request_id] = awaiting  # a good FirstToken may still come
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            await engine.add_first_token(request.request_id, request.first_token_id, kv)
        except EngineDeadError as e:
            await _fail(context, grpc.StatusCode.UNAVAILABLE, f"engine died: {e}")
        return pb.FirstTokenResponse(found=True)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        engine = await self._engine(context)
        found = request.request_id in self._active
        if found:
            await engine.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        """Whether the worker serves (and why not), its engine's queues and KV use. The engine
        core answers between steps, so a long step (a 2k-token prefill on CPU) would delay the
        report by up to a step: after LOAD_WAIT_S the last snapshot is returned instead, and the
        fresh one, when it comes, replaces it. Never fails: a worker whose engine is down says so."""
        serving = self.guard.serving
        why = "" if serving else self.guard.reason or "the engine core died"
        report = pb.LoadReport(role=_PROTO_ROLES[self.role], serving=serving, not_serving_reason=why,
                               instance_id=self.instance_id)
        if self.guard.engine is not None:
            report.tensor_parallel_size = self.guard.engine.config.tensor_parallel_size
        stats = await self.snapshot(LOAD_WAIT_S)
        if stats is not None:
            report.MergeFrom(pb.LoadReport(
                num_waiting=stats.num_waiting, num_running=stats.num_running, kv_usage=stats.kv_usage,
                num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
                prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
                num_cached_blocks=stats.num_cached_blocks, num_prompt_tokens=stats.num_prompt_tokens,
                busy_seconds=stats.step_seconds.total, max_model_len=stats.max_model_len,
                block_layer_share=stats.block_layer_share,
                kv_events_published=stats.kv_events_published,
                kv_events_endpoint=stats.kv_events_endpoint,
                kv_events_replay_endpoint=stats.kv_events_replay_endpoint,
                kv_events_topic=stats.kv_events_topic, kv_events_epoch=stats.kv_events_epoch))
        return report

    async def snapshot(self, wait_s: float) -> EngineStats | None:
        """The engine's stats: a fresh snapshot when the core answers within `wait_s` (longer for
        an engine's first), else the last one; None without a live engine. Load and metrics
        scrapes share one request to the core, so a frozen core holds one thread, not one per
        call."""
        engine = self.engine
        if engine is None or engine.errored:
            return None
        if engine is not self._stats_engine:  # a restarted engine starts over
            self._stats_engine, self._stats, self._stats_task = engine, None, None
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(engine.get_stats())
            self._stats_task.add_done_callback(lambda task: self._keep_stats(engine, task))
        if self._stats is None:  # an engine's first snapshot: there is none to fall back on
            wait_s = max(wait_s, FIRST_LOAD_WAIT_S)
        try:
            return await asyncio.wait_for(asyncio.shield(self._stats_task), wait_s)
        except (TimeoutError, EngineDeadError):
            return self._stats if not engine.errored else None

    async def _generate(self, context: grpc.aio.ServicerContext, request_id: str, ids: list[int],
                        params: SamplingParams, priority: int = 0, num_prior_outputs: int = 0,
                        cache_salt: str = "", awaiting: tuple[list[int], str] | None = None
                        ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; errors become status codes, cancel aborts. The
        call's initial metadata goes out as soon as the engine has the request, so the client
        knows it was accepted before the first token (the router starts its HTTP response there).
        A non-empty `cache_salt` keeps the request's KV apart from other salts'. `awaiting`: an
        early hand-off's (prompt, salt), which FirstToken finds once the engine has the request
        (a token sent to the engine after the request, never before it)."""
        engine = await self._engine(context)
        if not request_id:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:  # what the router would refuse (services/limits.py), the engine's limits known now
            check_request(params, len(ids) - num_prior_outputs, cache_salt, engine.config.model_len,
                          engine.processor.vocab_size)
        except ValueError as e:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request_id in self._active:
            await _fail(context, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is running")
        self._active.add(request_id)
        try:
            prompt: PromptType = {"prompt_token_ids": ids, "cache_salt": cache_salt} if cache_salt else ids
            async def added() -> None:
                if awaiting is not None:
                    self._awaiting[request_id] = awaiting
                await context.send_initial_metadata(())

            async for out in engine.generate(prompt, params, request_id, priority=priority,
                                             on_added=added, num_prior_outputs=num_prior_outputs,
                                             await_first_token=awaiting is not None):
                yield out
        except ValueError as e:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await _fail(context, grpc.StatusCode.UNAVAILABLE, f"engine died: {e}")
        except asyncio.CancelledError:  # the client cancelled or the server is stopping
            await asyncio.shield(engine.abort(request_id))
            raise
        except GeneratorExit:  # closed while at a yield (the call ended: call_end.py): no awaiting
            engine.abort_nowait(request_id)
            raise
        finally:
            self._active.discard(request_id)

    async def _engine(self, context: grpc.aio.ServicerContext) -> AsyncLLM:
        engine = self.guard.engine
        if engine is None or not self.guard.serving:
            why = self.guard.reason or "the engine core died"
            await _fail(context, grpc.StatusCode.UNAVAILABLE, f"not serving: {why}")
        return engine


def _check_early(role: str, kv: dict[str, Any] | None, num_ids: int, num_output_tokens: int) -> None:
    """What a Decode with await_first_token must be (ValueError naming the field)."""
    if role != "decode":
        raise ValueError(f"await_first_token: only a decode worker takes it (this one is {role})")
    if kv is None:
        raise ValueError("await_first_token: kv_transfer with do_remote_prefill must name the producer")
    if kv["num_tokens"] != num_ids:
        raise ValueError(f"kv_transfer.num_tokens: must be the prompt's {num_ids} tokens with "
                         f"await_first_token, got {kv['num_tokens']}")
    if num_output_tokens:
        raise ValueError("num_output_tokens: must be 0 with await_first_token (the first token "
                         "comes with FirstToken)")


async def _parse(context: grpc.aio.ServicerContext, parse: Callable[[], T]) -> T:
    try:
        return parse()
    except ValueError as e:
        await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """Ends the call with `code` (context.abort raises)."""
    await context.abort(code, message)
    raise AssertionError("unreachable")
