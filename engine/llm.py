"""Offline batch generation (vLLM's `LLM`): the engine core runs in this process.

    llm = LLM(model="smollm2-135m-instruct", max_model_len=2048)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.core.outputs import EngineStats
from engine.core_client import InprocClient
from engine.engine_core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType, prompt_cache_salt
from engine.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generates completions for batches of prompts; keyword arguments are EngineConfig fields.

    Bad input raises ValueError before anything is queued, and the engine keeps serving.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **config_fields: Any) -> None:
        from engine.model.loader import load_tokenizer, resolve_model_path

        self.client = InprocClient(EngineConfig(model=model, **config_fields))
        self.config = self.client.config
        tokenizer_path = (resolve_model_path(self.config.tokenizer) if self.config.tokenizer
                          else self.client.engine_core.model_path)
        self.tokenizer = load_tokenizer(tokenizer_path)
        from engine.model.loader import model_eos_token_ids

        self.processor = Processor(self.config, self.tokenizer, self.client.vocab_size,
                                   model_eos_token_ids(self.client.engine_core.model_path))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def engine_core(self) -> EngineCore:
        """The in-process EngineCore (for inspection: stats, free blocks)."""
        return self.client.engine_core

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        return self.client.get_stats()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]] | dict[str, Any] | list[dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. A prompt dict
        ({"prompt": text} or {"prompt_token_ids": ids}) may carry a `cache_salt`: only
        prompts of the same salt share cached KV."""
        return self._run(_as_prompt_list(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Like `generate`, for chat conversations (rendered with the chat template)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self._run(list(conversations), sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self, prompts: list[PromptType],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        params_list = _as_params_list(sampling_params, len(prompts))
        prepared = []
        for prompt, params in zip(prompts, params_list, strict=True):  # validate everything first
            params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            text, token_ids = self.processor.preprocess(prompt)
            request_id = str(next(self._ids))
            prepared.append((request_id, text, params, self.processor.make_requests(
                request_id, token_ids, params, cache_salt=prompt_cache_salt(prompt))))
        order = {request_id: i for i, (request_id, *_) in enumerate(prepared)}
        results: list[RequestOutput | None] = [None] * len(prepared)
        try:
            for request_id, text, params, requests in prepared:
                self.output_processor.add_request(request_id, text, requests, params)
                for request in requests:
                    self.client.add_request(request)
            with tqdm(total=len(prepared), desc="Processed prompts", disable=not use_tqdm) as bar:
                for output in self._drain():
                    results[order[output.request_id]] = output
                    bar.update(1)
        finally:  # on errors or interrupts, leave the engine clean for the next call
            self.client.abort_requests(self.output_processor.abort_requests(list(order)))
        return [r for r in results if r is not None]

    def _drain(self) -> Any:
        """Steps the core until every tracked request finished, yielding finished outputs."""
        while self.output_processor.has_unfinished_requests():
            outputs = self.client.get_output()
            processed = self.output_processor.process_outputs(outputs.outputs)
            if processed.reqs_to_abort:
                self.client.abort_requests(processed.reqs_to_abort)
            yield from (o for o in processed.request_outputs if o.finished)
            if not outputs.outputs and not self.engine_core.has_unfinished_requests():
                raise RuntimeError("the engine core has no requests left but outputs are missing")


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, token ids, or a non-empty list of them")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params
