"""The samples of one request, as vLLM numbers them: `n` per prompt of a batch, sample i of prompt
k being choice `k * n + i`; with `best_of`, best_of samples per prompt of which the n whose
sampled tokens have the highest cumulative logprob are kept, best first.

    opts = RunOptions(params, n=2, best_of=3)
    specs = plan("cmpl-1", num_prompts=2, opts=opts)   # request id, index, prompt, params of each
    async for delta in merged(sample_generators): ...  # interleaved as they come
    kept = keep_best(all_deltas, opts, num_prompts=2)  # re-indexed k * n + rank
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from engine.processor import child_request_id
from engine.sampling_params import SamplingParams
from services.worker.client import PositionLogprobs


@dataclass
class Delta:
    """New output of one sample; the last one has finish_reason set. One with neither tokens nor
    finish_reason (`accepted`) only says a worker has the sample and is computing its prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None
    completion_tokens: int
    cached_tokens: int
    text_offset: int = 0  # characters of this sample's token strings before this delta's tokens
    top_n: int = 0  # top logprobs asked for per position
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # positions 1.., first delta

    @property
    def accepted(self) -> bool:
        return not self.token_ids and not self.finish_reason


@dataclass(frozen=True)
class RunOptions:
    """What every sample of a request shares besides its prompt."""

    params: SamplingParams  # sample i of a prompt runs params.for_child(i): seed + i
    n: int = 1
    best_of: int | None = None  # samples per prompt to keep the n best of (None: n)
    stops: tuple[str, ...] = ()
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0  # the workers' scheduling priority (lower first)
    cache_salt: str = ""  # the effective salt (tenant and request): KV shared only within it

    @property
    def per_prompt(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def ranks(self) -> bool:
        """Whether only the best n samples of each prompt are kept."""
        return self.per_prompt > self.n

    @property
    def sample_params(self) -> SamplingParams:
        """The workers' parameters: ranking needs the sampled tokens' logprobs, asked or not."""
        if self.ranks and self.params.logprobs is None:
            return replace(self.params, logprobs=0)
        return self.params


@dataclass(frozen=True)
class SampleSpec:
    request_id: str
    index: int  # prompt * per_prompt + i: the choice index, unless ranking re-numbers it
    prompt: int
    params: SamplingParams


def plan(request_id: str, num_prompts: int, opts: RunOptions) -> list[SampleSpec]:
    """Every sample to run: request ids `{id}` alone, `{i}_{id}` for n > 1, with `{id}-{k}` for
    prompt k of a batch (as vLLM names them)."""
    per = opts.per_prompt
    params = opts.sample_params
    specs = []
    for k in range(num_prompts):
        rid = request_id if num_prompts == 1 else f"{request_id}-{k}"
        for i in range(per):
            specs.append(SampleSpec(rid if per == 1 else child_request_id(rid, i), k * per + i, k,
                                    params.for_child(i)))
    return specs


async def merged(samples: Sequence[AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
    """The deltas of all `samples`, interleaved as they come; closing this closes them all."""
    if len(samples) == 1:
        async with aclosing(samples[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(sample: AsyncGenerator[Delta, None]) -> None:
        try:
            async with aclosing(sample):
                async for delta in sample:
                    queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in samples]
    try:
        for _ in samples:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def cumulative_logprob(deltas: Sequence[Delta]) -> float:
    """The sum of a sample's sampled-token logprobs (each position's first candidate)."""
    return sum(pos[0].logprob for d in deltas for pos in d.logprobs if pos)


def keep_best(deltas: Sequence[Delta], opts: RunOptions, num_prompts: int) -> list[Delta]:
    """The deltas of each prompt's n samples with the highest cumulative logprob (ties: the lower
    index), re-indexed `prompt * n + rank`, best first; their logprobs only if the user asked."""
    per = opts.per_prompt
    by_sample: dict[int, list[Delta]] = {i: [] for i in range(num_prompts * per)}
    for d in deltas:
        by_sample[d.index].append(d)
    kept = []
    for k in range(num_prompts):
        ranked = sorted(range(k * per, (k + 1) * per), key=lambda i: -cumulative_logprob(by_sample[i]))
        for rank, i in enumerate(ranked[:opts.n]):
            kept += [replace(d, index=k * opts.n + rank,
                             logprobs=d.logprobs if opts.params.logprobs is not None else [])
                     for d in by_sample[i]]
    return kept
