"""The router's one configuration (frozen, validated at start)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.router.api.reasoning import REASONING_PARSERS
from services.router.api.tools import TOOL_CALL_PARSERS, chat_template_text
from services.router.dispatch.dispatcher import DispatchOptions
from services.router.http.admin import parse_networks

DEFAULT_MAX_MODEL_LEN = 4096  # a router that has heard from no worker yet and was told no length
# Where workers registered through the admin API may be: private networks. Loopback, link-local
# (a cloud's metadata service is 169.254.169.254) and public addresses need listing.
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")


@dataclass(frozen=True)
class RouterConfig:
    model: str  # the served model name clients send
    tokenizer: str  # folder or hub id of the model's tokenizer
    # None: the smallest the workers report (DEFAULT_MAX_MODEL_LEN until one has); set: at most that.
    max_model_len: int | None = None
    dispatch: DispatchOptions = field(default_factory=lambda: DispatchOptions(decode=("127.0.0.1:50061",)))
    # When set, /v1/* needs `Authorization: Bearer <key>` with one of them (services/router/http/tenants.py).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Each API key its own tenant: KV is shared only among requests authenticated with one key.
    tenant_cache_salt: bool = False
    # Keys of the admin API (/admin/*), which the API keys of tenants never open.
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    # The networks (CIDR) a worker added through the admin API must be in (every address its
    # name resolves to): the router sends it Load calls with the worker token.
    worker_networks: tuple[str, ...] = PRIVATE_NETWORKS
    max_waiting: int = 64  # admission: 429 once every healthy worker of a pool has this many queued
    max_inflight: int = 4096  # admission: 429 beyond this many requests in the router
    retry_after_s: int = 1
    # The edge (services/router/http/edge.py): bodies over max_body_bytes get 413; a request's headers
    # must arrive within header_timeout_s of its first byte and its body within body_timeout_s of
    # its headers, else 408 and the connection closes.
    max_body_bytes: int = 8 * 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # A request whose body is over inline_bytes is prepared (parsed, its shape checked first, its
    # template rendered and its prompt tokenized) in a pool of tokenizer_threads threads, not on
    # the event loop (services/router/prepare.py): each caller (API key, else address) has at
    # most max_pooled_per_caller of them under way, all callers max_pooled; of bodies over
    # heavy_bytes max_heavy_per_caller and max_heavy (more: 429), so a few callers cannot keep the
    # pool busy for everyone.
    tokenizer_threads: int = 2
    inline_bytes: int = 4096
    heavy_bytes: int = 256 * 1024
    max_pooled_per_caller: int = 32
    max_pooled: int = 128
    max_heavy_per_caller: int = 2
    max_heavy: int = 8
    disable_docs: bool = False  # no /docs, /redoc, /openapi.json (404); with api_key they need it
    # Which grammar backend compiles a request's structured-output constraint, unless the request
    # names one (guided_decoding_backend): "auto" is xgrammar, else llguidance (as vLLM's).
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = "auto"
    # Chat templates and tool calling, as vLLM's flags: a Jinja file (or the name of one pdserve
    # ships, services/router/templates) replacing the tokenizer's chat template; the parser of
    # the calls a model writes, which tool_choice "auto" needs along with enable_auto_tool_choice.
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's --reasoning-parser: a chat's <think>...</think> part goes to the message's reasoning
    # (services/router/api/reasoning.py), the rest is its content (tool calls parsed from it).
    reasoning_parser: str | None = None
    # The Responses API's store (`store`, `previous_response_id`, GET /v1/responses/{id}): off
    # unless enabled, as vLLM's; bounded by count and size (services/router/responses/store.py).
    enable_responses_store: bool = False
    responses_store_size: int = 1000
    responses_store_mb: int = 256

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.max_waiting < 1 or self.max_inflight < 1 or self.retry_after_s < 1:
            raise ValueError("max_waiting, max_inflight and retry_after_s must be at least 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("header_timeout_s and body_timeout_s must be positive")
        if self.tenant_cache_salt and not self.api_keys:
            raise ValueError("tenant_cache_salt: tenants are API keys, and none is configured")
        if any(not k or k != k.strip() or "," in k for k in self.api_keys + self.admin_keys):
            raise ValueError("api_keys: every key must be non-empty, without spaces around it or ','")
        if self.tokenizer_threads < 1 or not 0 <= self.inline_bytes <= self.heavy_bytes:
            raise ValueError("tokenizer_threads must be >= 1 and 0 <= inline_bytes <= heavy_bytes")
        for per, total, name in ((self.max_heavy_per_caller, self.max_heavy, "heavy"),
                                 (self.max_pooled_per_caller, self.max_pooled, "pooled")):
            if not 1 <= per <= total:
                raise ValueError(f"max_{name}_per_caller: must be in [1, max_{name}={total}], got {per}")
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise ValueError(f"structured_outputs_backend: must be auto, xgrammar or guidance, got "
                             f"{self.structured_outputs_backend!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser: must be one of {TOOL_CALL_PARSERS}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser: must be one of {REASONING_PARSERS}, got "
                             f"{self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (as vLLM's flags)")
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # a missing file fails at start, not per request
        parse_networks(self.worker_networks)
        if self.responses_store_size < 1 or self.responses_store_mb < 1:
            raise ValueError("responses_store_size and responses_store_mb must be at least 1")

    @property
    def auto_tools(self) -> bool:
        """Whether tool_choice "auto" can be served: calls are parsed out of free text."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None
