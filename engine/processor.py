"""Front-end input processing (vLLM's `Processor`): prompt -> validated `EngineCoreRequest`s.

Text prompts are tokenized as the tokenizer does by default (special tokens added); chat
messages go through the tokenizer's chat template with the generation prompt; token-id prompts
are taken as they are. `n > 1` fans out into `n` core requests `"{i}_{request_id}"`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from engine.core.outputs import EngineCoreRequest
from engine.sampling_params import SamplingParams
from engine.structured.select import choose_backend

# A prompt: text, token ids, chat messages ({"role": ..., "content": ...}), or vLLM's prompt
# dict: {"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt".
PromptType = str | list[int] | list[dict[str, Any]] | dict[str, Any]
_PROMPT_DICT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class Processor:
    """Tokenizes and validates prompts against a resolved `EngineConfig`.

    Every error is a ValueError naming the problem, raised before anything reaches the core.
    """

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int | None = None,
                 model_eos_token_ids: list[int] | None = None) -> None:
        self.config = config
        self.max_model_len = config.model_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        # the model's other eos ids: the engine core stops on them like stop ids (as vLLM)
        self.extra_eos_token_ids = [t for t in model_eos_token_ids or [] if t != self.eos_token_id]

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """The core requests of one user request (one per sample)."""
        _, token_ids = self.preprocess(prompt)
        return self.make_requests(request_id, token_ids, params, arrival_time, priority,
                                  cache_salt=prompt_cache_salt(prompt))

    def preprocess(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None for token ids, prompt token ids), validated."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids)
        return text, token_ids

    def check_token_ids(self, token_ids: list[int]) -> list[int]:
        """`preprocess` of a token-id prompt whose items the caller already knows are ints (an
        API layer validated the request's types): only its length and id range are checked,
        which spares a per-item type pass over long prompts."""
        self._validate(token_ids)
        return token_ids

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        num_prior_outputs: int = 0,
        cache_salt: str | None = None,
        await_first_token: bool = False,
    ) -> list[EngineCoreRequest]:
        """Fans `params.n` out into core requests; max_tokens=None becomes the room left.
        `num_prior_outputs`: the last that many token ids are earlier outputs of the sample
        (one sample only), which this engine continues. `cache_salt`: only requests of the
        same salt share cached KV (EngineCoreRequest.cache_salt)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.vocab_size)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} given but this engine's scheduling_policy is "
                             f"{self.config.scheduling_policy!r}, which ignores it (start it with "
                             f"the 'priority' policy, or send priority 0)")
        if not 0 <= num_prior_outputs < len(prompt_token_ids):
            raise ValueError(f"num_output_tokens must be in [0, {len(prompt_token_ids)}) (at least "
                             f"one prompt token), got {num_prior_outputs}")
        if (num_prior_outputs or await_first_token) and params.n != 1:
            raise ValueError("n must be 1 when continuing a sample's earlier outputs")
        if await_first_token and params.structured_outputs is not None:
            raise ValueError("structured_outputs: not with await_first_token (send the decode "
                             "after the prefill)")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(prompt_token_ids)
                             + num_prior_outputs)
        check_cache_salt(cache_salt)
        if params.structured_outputs is not None and params.structured_outputs.backend is None:
            params = replace(params, structured_outputs=choose_backend(
                params.structured_outputs, self.config.structured_outputs_backend))
        arrival = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            return [self._request(request_id, prompt_token_ids, params, arrival, priority,
                                  num_prior_outputs, cache_salt, await_first_token)]
        return [
            self._request(child_request_id(request_id, i), prompt_token_ids,
                          params.for_child(i), arrival, priority, cache_salt=cache_salt)
            for i in range(params.n)
        ]

    def _request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 arrival_time: float, priority: int, num_prior_outputs: int = 0,
                 cache_salt: str | None = None, await_first_token: bool = False) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
            num_prior_outputs=num_prior_outputs,
            cache_salt=cache_salt,
            await_first_token=await_first_token,
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return self._tokenize(_prompt_of_dict(prompt))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must not be empty" if isinstance(prompt, list) else
                             f"prompt must be a string, token ids or chat messages, got "
                             f"{type(prompt).__name__}")
        if all(isinstance(m, dict) for m in prompt):
            text = self.apply_chat_template(prompt)  # type: ignore[arg-type]
            return text, list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if set(map(type, prompt)) == {int} or all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prompt):  # the first test is the fast one
            return None, list(prompt)  # type: ignore[arg-type]
        raise ValueError("prompt must be a string, a list of token ids or a list of chat messages")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat prompt text, ending with the assistant's generation prompt (unless asked not
        to), or with the last message left open (`continue_final_message`, as transformers').
        `template_kwargs` are more variables for the template."""
        for m in messages:
            if "role" not in m or "content" not in m:
                raise ValueError("chat messages must have 'role' and 'content'")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass a text prompt instead")
        text: str = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **(template_kwargs or {}))
        return text

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of `bad_words`: each word (leading spaces stripped) as it reads at
        the start of a text, and with one leading space as it reads mid-text when that gives
        another first token and as many tokens."""
        out: list[list[int]] = []
        for word in words:
            plain = list(self.tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
            spaced = list(self.tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
            if not plain:
                raise ValueError(f"bad_words: {word!r:.40} has no tokens")
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def _validate(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, longer than max_model_len={self.max_model_len} allows "
                f"(the prompt plus at least one output token must fit)")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} out of range [0, {self.vocab_size})")


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """The `cache_salt` of a prompt dict (checked), None for any other prompt."""
    if not isinstance(prompt, dict):
        return None
    salt = prompt.get("cache_salt")
    check_cache_salt(salt)
    return salt


def check_cache_salt(salt: object) -> None:
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.40}")


def _prompt_of_dict(prompt: dict[str, Any]) -> str | list[int]:
    unknown = sorted(set(prompt) - _PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict: unknown keys {unknown} (known: {sorted(_PROMPT_DICT_KEYS)})")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    inner = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if "prompt" in prompt and not isinstance(inner, str):
        raise ValueError("prompt dict: 'prompt' must be a string")
    if "prompt_token_ids" in prompt and not isinstance(inner, list):
        raise ValueError("prompt dict: 'prompt_token_ids' must be a list of token ids")
    return inner  # type: ignore[return-value]


def child_request_id(request_id: str, index: int) -> str:
    """Core request id of the `index`-th sample of a request with n > 1."""
    return f"{index}_{request_id}"
