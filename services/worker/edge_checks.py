"""The worker's gRPC edge: a call reaching a worker directly gets no more than one through the
router (services/limits.py), and a message that does not parse is INVALID_ARGUMENT.

    check_request(params, num_tokens, cache_salt, max_model_len, vocab_size)  # ValueError naming the field
    server = grpc.aio.server(interceptors=[..., MalformedRequests()])

Each refusal is a ValueError naming the field, which the servicer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from engine.sampling_params import SamplingParams
from services import limits


def check_request(params: SamplingParams, num_tokens: int, cache_salt: str, max_model_len: int | None,
                  vocab_size: int | None) -> None:
    """ValueError naming the first field the router would have refused. `max_model_len` and
    `vocab_size` are the engine's (None while it starts: the engine checks them itself then)."""
    floats = {"temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
              "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
              "repetition_penalty": params.repetition_penalty}
    for name, value in floats.items():
        _check(math.isfinite(value), name, f"must be a finite number, got {value}")
    _check(params.temperature <= limits.MAX_TEMPERATURE, "temperature",
           f"must be at most {limits.MAX_TEMPERATURE}, got {params.temperature}")
    _check(params.repetition_penalty <= limits.MAX_REPETITION_PENALTY, "repetition_penalty",
           f"must be at most {limits.MAX_REPETITION_PENALTY}, got {params.repetition_penalty}")
    _check(params.top_k <= limits.MAX_TOP_K, "top_k",
           f"must be at most {limits.MAX_TOP_K}, got {params.top_k}")
    _check(len(cache_salt) <= limits.MAX_CACHE_SALT, "cache_salt",
           f"must be at most {limits.MAX_CACHE_SALT} characters, got {len(cache_salt)}")
    _check(len(params.stop_token_ids) <= limits.MAX_STOP, "stop_token_ids",
           f"at most {limits.MAX_STOP}, got {len(params.stop_token_ids)}")
    for name, items in (("logit_bias", params.logit_bias or {}),
                        ("allowed_token_ids", params.allowed_token_ids or [])):
        _check(len(items) <= limits.MAX_LIST_FIELD, name, f"at most {limits.MAX_LIST_FIELD} entries, "
                                                          f"got {len(items)}")
    words = params.bad_words_token_ids or []
    _check(len(words) <= 2 * limits.MAX_STOP, "bad_words",
           f"at most {2 * limits.MAX_STOP} token sequences ({limits.MAX_STOP} words), got {len(words)}")
    _check(all(len(w) <= limits.MAX_BAD_WORD_TOKENS for w in words), "bad_words",
           f"a word has more than {limits.MAX_BAD_WORD_TOKENS} tokens")
    if max_model_len is not None and params.max_tokens is not None:
        _check(num_tokens + params.max_tokens <= max_model_len, "max_tokens",
               f"{params.max_tokens} plus the {num_tokens} tokens given exceed max_model_len={max_model_len}")
    if vocab_size is not None:
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
        _check(not bad, "stop_token_ids", f"has token id {bad[0] if bad else 0} outside the vocabulary "
                                          f"[0, {vocab_size})")
        params.check_vocab(vocab_size)


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")


class _Malformed:
    """A request message that did not parse (what the safe deserializer hands on)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


SERVICE_PREFIX = "/pdserve.worker.v1.Worker/"  # (the health service's Watch writes, not yields)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Turns a request message of the worker service that does not parse into INVALID_ARGUMENT
    naming the method, instead of gRPC's UNKNOWN; streaming and unary responses alike."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_deserializer is None or handler.request_streaming
                or not handler_call_details.method.startswith(SERVICE_PREFIX)):
            return handler
        parse = handler.request_deserializer

        def safe(data: bytes) -> Any:
            try:
                return parse(data)
            except (DecodeError, ValueError, TypeError) as e:
                return _Malformed(e)

        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{method}: the request message does not parse: {request.error}")
                return await inner(request, context)

            return handler._replace(request_deserializer=safe, unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{method}: the request message does not parse: {request.error}")
                async for item in inner_stream(request, context):
                    yield item

            return handler._replace(request_deserializer=safe, unary_stream=stream)
        return handler
