"""What the scheduler counts for metrics, with vLLM's meanings (pure Python, a few adds a token).

Counters since start-up: prompt tokens (a request's whole prompt once, when its first token
comes, cached part included), generated tokens, preemptions. Histograms (`RequestHistograms`):

- per finished request: queue time (arrival -> first scheduled), prefill time (first scheduled
  -> first token), decode time (first token -> last token), inference time (first scheduled ->
  last token), its prompt tokens and the tokens generated here, `n` and the most tokens one
  of its samples generated (1 and that same count: the engine core serves one sample per
  request; the router fans `n` out and reports the client's `n`);
- per token after a request's first here: the time since its previous token;
- per step that produced tokens: the prompt and generated tokens it counted.

Each sample enters the per-sample histograms (generation tokens, `n`, the longest sample) once,
with its whole length, so they summed over every worker count what clients received: a request
that continues a sample (a decode half, a migrated sample) counts the outputs it was handed too,
and the prefill half of a split sample (`do_remote_decode`) counts only when its first token
ends the sample (the hints `sample_max_tokens` / `sample_min_tokens` of its kv_transfer_params
say when: the client's max_tokens reached, or EOS / a stop token allowed to stop it); an aborted
prefill half never counts (the sample goes on elsewhere, or the client left before any token).

Times are the request's `RequestTimes`; vLLM measures queue time from the core's QUEUED event,
here from the front end's arrival (the hop to the core included). A request carrying
`do_remote_prefill` continues a prompt another engine computed and counted (a disaggregated
request's decode half, sent the client's prompt and the prefill's first token): its prompt
counts nowhere here, so the prompt tokens of every worker summed count each prompt once. Its
generated tokens count as usual; the prefill worker counted the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import RequestHistograms
from engine.core.request import Request, RequestStatus


def continues_remote_prefill(request: Request) -> bool:
    params = request.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_prefill"))


def sample_goes_on_elsewhere(request: Request) -> bool:
    """Whether a finished request is the prefill half of a sample that another worker continues
    (so the sample is counted there, not here)."""
    params = request.sampling_params.kv_transfer_params
    if not (params and params.get("do_remote_decode")):
        return False
    if request.status == RequestStatus.FINISHED_ABORTED or not request.output_token_ids:
        return True
    most = params.get("sample_max_tokens")
    if most is not None and request.num_output_tokens >= most:
        return False
    if request.num_output_tokens < params.get("sample_min_tokens", 0):
        return True
    last, sampling = request.output_token_ids[-1], request.sampling_params
    stops = (not sampling.ignore_eos and last == request.eos_token_id) or last in sampling.stop_token_ids
    return not stops


@dataclass
class SchedulerCounters:
    """Totals and histograms since start-up; the scheduler calls `on_tokens` for each request
    that got tokens in a step, `on_finished` for each request it ends with an output, and
    `end_step` once per step."""

    prompt_tokens: int = 0  # prompts of requests that produced their first token
    generation_tokens: int = 0
    preemptions: int = 0
    histograms: RequestHistograms = field(default_factory=RequestHistograms.create)
    _step_tokens: int = 0

    @classmethod
    def create(cls, max_model_len: int) -> SchedulerCounters:
        return cls(histograms=RequestHistograms.create(max_model_len))

    def on_tokens(self, request: Request, num_new: int, now: float) -> None:
        """`num_new` tokens generated for `request` at `now`."""
        times = request.times
        if not times.first_token_time:
            times.first_token_time = now
            if not continues_remote_prefill(request):
                self.prompt_tokens += request.num_prompt_tokens
                self._step_tokens += request.num_prompt_tokens
        else:
            self.histograms.time_per_output_token.observe(now - times.last_token_time)
        times.last_token_time = now
        times.num_generated_tokens += num_new
        self.generation_tokens += num_new
        self._step_tokens += num_new

    def on_finished(self, request: Request) -> None:
        h, t = self.histograms, request.times
        if t.first_scheduled_time and t.arrival_time:
            h.queue_seconds.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
        if t.first_token_time:
            h.prefill_seconds.observe(t.first_token_time - t.first_scheduled_time)
            h.decode_seconds.observe(t.last_token_time - t.first_token_time)
            h.inference_seconds.observe(t.last_token_time - t.first_scheduled_time)
            if not continues_remote_prefill(request):
                h.prompt_tokens.observe(request.num_prompt_tokens)
        if not sample_goes_on_elsewhere(request):
            h.generation_tokens.observe(request.num_output_tokens)
            h.max_num_generation_tokens.observe(request.num_output_tokens)
            h.params_n.observe(request.sampling_params.n)

    def end_step(self) -> None:
        if self._step_tokens:
            self.histograms.iteration_tokens.observe(self._step_tokens)
            self._step_tokens = 0
