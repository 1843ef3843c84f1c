"""Wire messages <-> engine values for the worker service. Errors are ValueErrors naming the field."""

from __future__ import annotations

import functools
from typing import Any

from engine.connector.transfer_params import check_transfer_params
from engine.outputs import CompletionOutput, PromptLogprobs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured.params import StructuredOutputsParams
from engine.structured.select import choose_backend
from protos import worker_pb2 as pb

# A prompt's logprobs (prompt_logprobs: about 16 bytes per candidate per prompt token) outgrow
# gRPC's default 4 MiB: 64 MiB holds top-20 for prompts of ~190k tokens.
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_SIZE_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def params_from_proto(msg: pb.SamplingParams, output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                      kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    """The engine's SamplingParams of one sample; SamplingParams' own validation applies."""
    return SamplingParams(
        n=1, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty, max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens, stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.token_ids) for w in msg.bad_words] or None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        output_kind=output_kind, kv_transfer_params=kv_transfer_params,
        structured_outputs=(structured_from_proto(msg.structured_outputs)
                            if msg.HasField("structured_outputs") else None))


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The wire form of `params` (n, stop strings and the output kind are not sent)."""
    if params.max_tokens is None:
        raise ValueError("max_tokens must be set for a worker request")
    return pb.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        seed=params.seed, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos, logprobs=params.logprobs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids, prompt_logprobs=params.prompt_logprobs,
        bad_words=[pb.TokenIds(token_ids=w) for w in params.bad_words_token_ids or ()],
        structured_outputs=structured_to_proto(params.structured_outputs))


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """ValueError naming the field when no constraint is set, the backend is unknown, or the
    backend named does not compile the spec (the engine's Processor checks specs only when no
    backend is chosen yet: a bad spec must fail this call, not the grammar's compile later)."""
    try:
        return _structured(msg.SerializeToString(deterministic=True))
    except RecursionError as e:  # JSON text nested past what json.loads parses
        raise ValueError(f"structured_outputs: nested too deeply ({e})") from None


@functools.lru_cache(maxsize=256)
def _structured(wire: bytes) -> StructuredOutputsParams:
    """Kept per spec (failures are not: lru_cache keeps no exceptions): callers repeat their
    schemas, and checking one costs milliseconds."""
    msg = pb.StructuredOutputs.FromString(wire)
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs must set one constraint")
    if msg.backend not in ("", "xgrammar", "guidance"):
        raise ValueError(f"structured_outputs.backend must be xgrammar or guidance, got {msg.backend!r}")
    value: Any = getattr(msg, kind)
    name = {"json_schema": "json", "choice": "choice"}.get(kind, kind)
    if kind == "choice":
        value = list(msg.choice.choices)
    params = StructuredOutputsParams(
        **{name: value}, disable_any_whitespace=msg.disable_any_whitespace,
        whitespace_pattern=msg.whitespace_pattern if msg.HasField("whitespace_pattern") else None)
    return choose_backend(params, msg.backend) if msg.backend else params


def structured_to_proto(params: StructuredOutputsParams | None) -> pb.StructuredOutputs | None:
    if params is None:
        return None
    msg = pb.StructuredOutputs(disable_any_whitespace=params.disable_any_whitespace,
                               whitespace_pattern=params.whitespace_pattern, backend=params.backend or "")
    kind = params.kind
    if kind == "json":
        msg.json_schema = params.json or ""
    elif kind == "choice":
        msg.choice.choices.extend(params.choice or [])
    elif kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, kind, getattr(params, kind))
    return msg


def kv_params_from_proto(msg: pb.KVTransferParams | None, num_tokens: int, chunk_size: int
                         ) -> dict[str, Any] | None:
    """The engine's kv_transfer_params of a Decode call on `num_tokens` token ids: None when
    unset or not a remote prefill; ValueError naming the field for values a consumer cannot use
    (engine/connector/transfer_params.py)."""
    if msg is None or not msg.do_remote_prefill:
        return None
    params = kv_params_to_dict(msg)
    check_transfer_params(params, num_tokens, chunk_size)
    return params


def kv_params_to_dict(msg: pb.KVTransferParams) -> dict[str, Any]:
    return {"do_remote_prefill": msg.do_remote_prefill, "keys": list(msg.keys),
            "num_tokens": msg.num_tokens, "transfer_id": msg.transfer_id,
            "kv_store_url": msg.kv_store_url, **({"tp_size": msg.tp_size} if msg.tp_size else {})}


def kv_params_to_proto(params: dict[str, Any] | None) -> pb.KVTransferParams | None:
    """The wire form of a producer's kv_transfer_params (None stays None)."""
    if params is None:
        return None
    return pb.KVTransferParams(
        do_remote_prefill=bool(params.get("do_remote_prefill", False)),
        keys=[str(k) for k in params.get("keys", [])], num_tokens=int(params.get("num_tokens", 0)),
        transfer_id=str(params.get("transfer_id", "")), kv_store_url=str(params.get("kv_store_url", "")),
        tp_size=int(params.get("tp_size") or 0))


def token_ids_from_proto(token_ids: Any) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise ValueError("token_ids must not be empty")
    return ids


def position_to_proto(position: dict[int, Any]) -> pb.PositionLogprobs:
    """One position's logprobs (the sampled token first, then the top candidates)."""
    return pb.PositionLogprobs(candidates=[pb.Logprob(token_id=t, logprob=lp.logprob, rank=lp.rank or 0)
                                           for t, lp in position.items()])


def prompt_logprobs_to_proto(positions: PromptLogprobs | None) -> list[pb.PositionLogprobs]:
    """The wire form of a RequestOutput's prompt_logprobs (the first position's None left out)."""
    return [position_to_proto(p) for p in (positions or [])[1:] if p is not None]


def chunk_from_output(sample: CompletionOutput, prompt_logprobs: PromptLogprobs | None = None
                      ) -> pb.DecodeChunk:
    """A DecodeChunk of one DELTA output (no usage; the server adds it to the last chunk)."""
    chunk = pb.DecodeChunk(token_ids=sample.token_ids, finish_reason=sample.finish_reason or "",
                           prompt_logprobs=prompt_logprobs_to_proto(prompt_logprobs))
    chunk.logprobs.extend(position_to_proto(position) for position in sample.logprobs or [])
    if isinstance(sample.stop_reason, int):
        chunk.stop_token_id = sample.stop_reason
    elif isinstance(sample.stop_reason, str):
        chunk.stop_text = sample.stop_reason
    return chunk
