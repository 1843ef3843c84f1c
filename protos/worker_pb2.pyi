from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_COLOCATED: Role

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prompt_logprobs: int
    structured_outputs: StructuredOutputs
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace", "whitespace_pattern", "backend")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    structural_tag: str
    disable_any_whitespace: bool
    whitespace_pattern: str
    backend: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., whitespace_pattern: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "transfer_id", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    transfer_id: str
    priority: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., transfer_id: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("do_remote_prefill", "keys", "num_tokens", "transfer_id", "kv_store_url", "tp_size")
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_URL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    do_remote_prefill: bool
    keys: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    transfer_id: str
    kv_store_url: str
    tp_size: int
    def __init__(self, do_remote_prefill: _Optional[bool] = ..., keys: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ..., kv_store_url: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "num_cached_tokens", "first_logprobs", "kv_transfer", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    num_cached_tokens: int
    first_logprobs: PositionLogprobs
    kv_transfer: KVTransferParams
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "kv_transfer", "num_output_tokens", "priority", "cache_salt", "await_first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    AWAIT_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    kv_transfer: KVTransferParams
    num_output_tokens: int
    priority: int
    cache_salt: str
    await_first_token: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., await_first_token: _Optional[bool] = ...) -> None: ...

class FirstTokenRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_transfer: KVTransferParams
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...

class FirstTokenResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, candidates: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "stop_text", "usage", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_TEXT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: str
    stop_token_id: int
    stop_text: str
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_text: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_usage", "role", "num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_cached_blocks", "num_prompt_tokens", "busy_seconds", "serving", "not_serving_reason", "instance_id", "max_model_len", "block_layer_share", "tensor_parallel_size", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "kv_events_published", "kv_events_epoch")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LAYER_SHARE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_usage: float
    role: Role
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_blocks: int
    num_prompt_tokens: int
    busy_seconds: float
    serving: bool
    not_serving_reason: str
    instance_id: str
    max_model_len: int
    block_layer_share: float
    tensor_parallel_size: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_topic: str
    kv_events_published: int
    kv_events_epoch: str
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., role: _Optional[_Union[Role, str]] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., serving: _Optional[bool] = ..., not_serving_reason: _Optional[str] = ..., instance_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_layer_share: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., kv_events_topic: _Optional[str] = ..., kv_events_published: _Optional[int] = ..., kv_events_epoch: _Optional[str] = ...) -> None: ...
