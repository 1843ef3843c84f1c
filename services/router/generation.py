"""What the router does with one request between parsing and rendering: admission, tokenization
(off the event loop for long prompts), sampling parameters, and the text deltas of its samples.

    gen = Generator(config, tokenizer, dispatcher, metrics)
    admission = gen.admit()                       # 429 / 503 before any work
    ids = gen.tokenize(messages, "messages", template, truncate=None)  # or in gen.in_pool(...)
    async for delta in gen.run(request_id, [ids], RunOptions(params, n=2)): ...
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.output_processor import find_stop_string
from engine.processor import Processor
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from services.router.api.body_shape import ShapeLimits
from services.router.api.chat_options import TemplateOptions
from services.router.api.structured import BackendChoices, Constraint
from services.router.config import DEFAULT_MAX_MODEL_LEN, RouterConfig
from services.router.dispatch.dispatcher import Dispatcher
from services.router.errors import OpenAIError
from services.router.fanout import Delta, RunOptions, keep_best, merged, plan
from services.router.metrics import RouterMetrics

Text = str | list[dict[str, Any]]  # a text prompt, or chat messages
T = TypeVar("T")


class Admission:
    """One admitted request's hold on the router's in-flight count; `release` is idempotent."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.released = False
        gen.inflight += 1
        gen.metrics.running.inc()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gen.inflight -= 1
            self.gen.metrics.running.dec()

    async def release_async(self) -> None:
        """`release` for Starlette's BackgroundTask, which runs a sync function in a worker thread."""
        self.release()


class Generator:
    """Tokenizes a request, runs its samples, turns their token ids into text deltas."""

    def __init__(self, config: RouterConfig, tokenizer: Any, dispatcher: Dispatcher,
                 metrics: RouterMetrics) -> None:
        engine = EngineConfig(model=config.tokenizer,
                              max_model_len=config.max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.processor = Processor(engine, tokenizer)
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.inflight = 0
        self.backends = BackendChoices()
        # No token decodes to more characters than its longest vocabulary string.
        self._longest_token = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
        # Each pool thread tokenizes with a tokenizer of its own (no state shared across threads).
        local = threading.local()

        def own_processor() -> None:
            local.processor = Processor(engine, copy.deepcopy(tokenizer))

        self._local = local
        self._pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize",
                                        initializer=own_processor)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def admit(self) -> Admission:
        """Admission control, before any work: 429 (with Retry-After) when the router holds
        `max_inflight` requests or every healthy worker of a pool has `max_waiting` queued; 503 when
        no decode worker is healthy (no healthy prefill worker is fine: decode computes prompts)."""
        cfg = self.config
        retry = {"Retry-After": str(cfg.retry_after_s)}
        if not self.dispatcher.decode.healthy:
            self.metrics.rejected.labels("no_healthy_worker").inc()
            raise OpenAIError(503, f"no healthy {self.dispatcher.decode.role} worker; retry later",
                              code="worker_unavailable", headers=retry)
        if self.inflight >= cfg.max_inflight:
            self.metrics.rejected.labels("router_full").inc()
            raise OpenAIError(429, f"the router already serves {self.inflight} requests "
                                   f"(max_inflight={cfg.max_inflight}); retry later",
                              code="rate_limit_exceeded", headers=retry)
        for pool in self.dispatcher.pools:
            if pool.saturated(cfg.max_waiting):
                self.metrics.rejected.labels(f"{pool.role}_queue_full").inc()
                raise OpenAIError(429, f"every {pool.role} worker has {cfg.max_waiting} or more queued "
                                       f"requests; retry later", code="rate_limit_exceeded", headers=retry)
        return Admission(self)

    @property
    def max_model_len(self) -> int:
        """What a request may use: the smallest max_model_len the workers report, at most the
        configured one (the configured one, else DEFAULT_MAX_MODEL_LEN, before any report)."""
        learned, configured = self.dispatcher.max_model_len(), self.config.max_model_len
        if learned is None:
            return configured or DEFAULT_MAX_MODEL_LEN
        return min(learned, configured) if configured else learned

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this many characters cannot fit max_model_len tokens."""
        return self.max_model_len * self._longest_token

    @property
    def shape_limits(self) -> ShapeLimits:
        """How much JSON structure a large body may hold (api/body_shape.py)."""
        return ShapeLimits.for_model(self.max_model_len)

    @property
    def thread_tokenizer(self) -> Any:
        """The tokenizer of the thread this runs on (pool threads have their own)."""
        return self._here.tokenizer

    @property
    def _here(self) -> Processor:
        """The processor of the thread this runs on (a pool thread's own, else the loop's), with
        today's max_model_len."""
        own: Processor | None = getattr(self._local, "processor", None)
        proc = own if own is not None else self.processor
        proc.max_model_len = self.max_model_len
        return proc

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a tokenizer pool thread, in this task's context (the tenant's salt)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(context.run, fn, *args))

    def tokenize(self, prompt: Text, param: str, template: TemplateOptions | None = None,
                 truncate: int | None = None) -> list[int]:
        """The prompt's token ids (chat template applied), only its last `truncate` kept, checked,
        on the calling thread (a request's preparation runs in the pool when its body is large).
        Every character that goes into the prompt counts against max_model_len (the messages'
        strings, the tools, the template variables), checked before any template runs. Any error
        on user text is a 400 naming `param`, never a 500. A prompt to truncate may be longer than
        max_model_len."""
        template = template or TemplateOptions()
        chars = _chars(prompt, template)
        if truncate is None and chars > self.max_prompt_chars:
            what = f"{param} and tools" if template.tools else param
            raise OpenAIError(400, f"{what}: {chars} characters cannot fit in max_model_len="
                                   f"{self.max_model_len} tokens", param)
        special = isinstance(prompt, str)  # a chat template writes its own special tokens
        try:
            ids = _encode(self._here, prompt, template, special)
        except ValueError as e:
            raise OpenAIError(400, str(e), param) from e
        except Exception as e:  # the tokenizer or template refused the text (a lone surrogate...)
            raise OpenAIError(400, f"{param}: cannot be tokenized: {type(e).__name__}: {e}"[:500],
                              param) from e
        return self.check_token_ids(ids, param, truncate)

    def _pooled(self, prompt: Text, template: TemplateOptions, add_special_tokens: bool) -> list[int]:
        return _encode(self._local.processor, prompt, template, add_special_tokens)

    async def encode(self, prompt: Text, param: str, add_special_tokens: bool,
                     template: TemplateOptions | None = None) -> list[int]:
        """/tokenize: the token ids of a text or of chat messages (their template applied), in the
        pool, with no length limit (the count is the answer). Errors on user text are 400s."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._pooled, prompt, template or TemplateOptions(), add_special_tokens)
        except Exception as e:  # the tokenizer or template refused the text
            raise OpenAIError(400, f"{param}: cannot be tokenized: {type(e).__name__}: {e}"[:500],
                              param) from e

    async def decode(self, token_ids: list[int], param: str) -> tuple[str, list[str]]:
        """/detokenize: the text of `token_ids` (special tokens kept) and each token's string."""
        vocab = self.processor.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"{param}: token id {bad} out of range [0, {vocab})", param)

        def run() -> tuple[str, list[str]]:
            tok = self._local.processor.tokenizer
            return str(tok.decode(token_ids)), [str(s) for s in tok.convert_ids_to_tokens(token_ids)]

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def check_token_ids(self, token_ids: list[int], param: str, truncate: int | None = None) -> list[int]:
        """A token-id prompt whose items pydantic already checked are ints, its last `truncate`
        kept: length and range only."""
        if truncate is not None:
            token_ids = token_ids[-truncate:]  # left truncation, as vLLM's
        try:
            return self._here.check_token_ids(token_ids)
        except ValueError as e:
            raise OpenAIError(400, str(e), param) from e

    def truncation(self, keep: int | None, max_tokens: int | None) -> int | None:
        """truncate_prompt_tokens as the number of prompt tokens to keep (vLLM's): at most what fits
        beside max_tokens (at least one output token), -1 for exactly that; more is a 400."""
        if keep is None:
            return None
        room = self.max_model_len - max(max_tokens or 0, 1)
        if keep > room or room < 1:
            raise OpenAIError(400, f"truncate_prompt_tokens={keep} leaves no room for the output: at "
                                   f"most max_model_len={self.max_model_len} minus max_tokens "
                                   f"({max(max_tokens or 0, 1)}) = {room} prompt tokens fit",
                              "truncate_prompt_tokens")
        return room if keep == -1 else keep

    def constrain(self, constraint: Constraint | None) -> StructuredOutputsParams | None:
        """The request's structured-output constraint with its backend (the request's
        guided_decoding_backend, else the router's), checked: a 400 naming the field for a spec no
        backend compiles."""
        if constraint is None:
            return None
        preferred = constraint.backend or self.config.structured_outputs_backend
        return self.backends.choose(constraint.params, preferred)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens kept), on the calling thread."""
        return str(self._here.tokenizer.decode(token_ids))

    def params(self, prompt_len: int, max_tokens: int | None, fields: dict[str, Any],
               logprobs: int | None) -> SamplingParams:
        """One sample's SamplingParams (`fields` with its `structured_outputs` from `constrain`);
        the engine's own checks become 400s naming the field."""
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed "
                                   f"max_model_len={self.max_model_len}", "max_tokens")
        try:
            words = fields.pop("bad_words", None)
            bad = self._here.bad_words_token_ids(words) if words else None
            params = SamplingParams(**fields, logprobs=logprobs, bad_words_token_ids=bad,
                                    max_tokens=room if max_tokens is None else max_tokens)
            params.check_vocab(self.processor.vocab_size)
            return params
        except ValueError as e:
            raise OpenAIError(400, str(e), str(e).split(" ", 1)[0].rstrip(":")) from e

    async def run(self, request_id: str, prompts: Sequence[list[int]], opts: RunOptions
                  ) -> AsyncGenerator[Delta, None]:
        """The deltas of every sample of every prompt (fanout.py numbers them), interleaved as they
        come; with best_of, once all have ended, only those of each prompt's n best. A sample ends
        at the first of `opts.stops` in its text, which keeps that stop string when
        `opts.include_stop` (vLLM's include_stop_str_in_output)."""
        samples = [self._sample(s.request_id, s.index, prompts[s.prompt], s.params, opts)
                   for s in plan(request_id, len(prompts), opts)]
        per = opts.per_prompt
        ended: dict[int, tuple[int, int]] = {}  # prompt -> (samples finished, tokens of the longest)
        async with aclosing(merged(samples)) as deltas:
            every: list[Delta] = []
            async for delta in deltas:
                if delta.finish_reason:  # each prompt of a batch is one request, as in vLLM
                    k = delta.index // per
                    count, most = ended.get(k, (0, 0))
                    ended[k] = (count + 1, max(most, delta.completion_tokens))
                    if count + 1 == per:
                        self.metrics.request_finished(opts.n, ended[k][1])
                if opts.ranks:
                    every.append(delta)
                else:
                    yield delta
        for delta in keep_best(every, opts, len(prompts)) if opts.ranks else ():
            yield delta

    async def _sample(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                      opts: RunOptions) -> AsyncGenerator[Delta, None]:
        detok = IncrementalDetokenizer(self.tokenizer, opts.skip_special_tokens,
                                       opts.spaces_between_special_tokens)
        stops, include_stop = list(opts.stops), opts.include_stop
        # Text that may be the start of a stop string waits (unless stop strings are kept anyway).
        hold_back = 0 if include_stop else max((len(s) for s in stops), default=1) - 1
        text, sent, num_tokens, token_chars = "", 0, 0, 0
        start = last = time.perf_counter()
        async with aclosing(self.dispatcher.generate(request_id, prompt_ids, params, opts.priority,
                                                         opts.cache_salt)) as steps:
            async for step in steps:
                if step.accepted:  # a worker has the sample: nothing to say yet
                    yield Delta(index, "", [], [], None, num_tokens, 0)
                    continue
                now = time.perf_counter()
                if step.token_ids:
                    (self.metrics.ttft if num_tokens == 0 else self.metrics.itl).observe(now - last)
                    last = now
                # A worker's "stop" is a stop token (EOS or a stop_token_id; the router applies stop
                # strings): like vLLM, its text is left out unless stop strings are kept.
                stop_token = step.finish_reason == "stop" and not include_stop
                added, used, match = detok_until_stop(
                    detok, text, step.token_ids[:-1] if stop_token else step.token_ids,
                    bool(step.finish_reason), stops, include_stop)
                text += added
                finish = step.finish_reason or None
                token_ids, logprobs = step.token_ids, step.logprobs
                if match is not None:
                    text, finish = text[:match[1]], "stop"
                    # Tokens after the one completing the stop string never happened (a step
                    # carrying several tokens would otherwise report them: vLLM stops per token).
                    token_ids, logprobs = token_ids[:used], logprobs[:used] if logprobs else logprobs
                num_tokens += len(token_ids)
                end = len(text) if finish else max(sent, len(text) - hold_back)
                if finish:
                    self.metrics.e2e.observe(now - start)
                    self.metrics.success.labels(finish).inc()
                    self.metrics.generation_tokens.inc(num_tokens)
                yield Delta(index, text[sent:end], token_ids, logprobs, finish, num_tokens,
                            step.cached_tokens, token_chars, params.logprobs or 0, step.prompt_logprobs)
                if logprobs:  # completions' logprobs.text_offset continues from here
                    token_chars += sum(len(decode_token(self.tokenizer, t)) for t in token_ids)
                sent = end
                if finish:
                    return  # leaving the loop early cancels the decode call


def detok_until_stop(detok: IncrementalDetokenizer, text: str, ids: Sequence[int], finished: bool,
                     stops: list[str], include_stop: bool) -> tuple[str, int, tuple[str, int] | None]:
    """The text `ids` add after `text`, how many of them were used, and the stop-string match:
    with stop strings and several tokens, token by token up to the one that completes a stop
    string (the rest are not used)."""
    if not stops or len(ids) < 2:
        added = detok.update(list(ids), finished=finished)
        match = find_stop_string(text + added, len(text), stops, include_stop_str=include_stop)
        return added, len(ids), match
    added = ""
    for i, token in enumerate(ids):
        added += detok.update([token], finished=finished and i == len(ids) - 1)
        match = find_stop_string(text + added, len(text), stops, include_stop_str=include_stop)
        if match is not None:
            return added, i + 1, match
    return added, len(ids), None


def _encode(proc: Processor, prompt: Text, template: TemplateOptions, add_special_tokens: bool
            ) -> list[int]:
    text = prompt if isinstance(prompt, str) else proc.apply_chat_template(prompt, **template.as_kwargs())
    return list(proc.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def _chars(prompt: Text, template: TemplateOptions) -> int:
    """Characters a prompt puts into the template: a text prompt's, or every string of the chat
    messages (contents, names, tool calls' arguments...), of the tools and of the template
    variables (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    return _strings(prompt) + _strings(list(template.tools)) + _strings(dict(template.variables))


def _strings(value: object) -> int:
    """The characters of every string in a JSON-like value (keys included), without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
