"""The scheduler's structured-output side (pure Python: matchers, never tensors).

A request with `structured_outputs` waits in `waiting_for_fsm` (status WAITING_FOR_FSM) while
its grammar compiles in the structured-output manager's threads; other requests run meanwhile.
Once compiled it joins the waiting queue, its matcher advanced over the sample's earlier outputs
(the prefill worker's first token on a decode worker). Each step the scheduler lists the
constrained requests that sample (the engine fills their bitmask rows, or checks an argmax
row's choice first), and after the step
advances each matcher by the sampled tokens: a request whose grammar ended stops (`stop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.request_queue import RequestQueue


class GrammarWaits:
    waiting: RequestQueue
    requests: dict[str, Request]

    def __init__(self) -> None:
        self.waiting_for_fsm: dict[str, Request] = {}

    def _fail(self, request: Request, reason: str) -> None:  # KVLoads's
        raise NotImplementedError

    def _queue(self, request: Request) -> None:
        """A new request: to the waiting queue, or to wait for its grammar."""
        if request.grammar is not None and request.grammar.matcher is None:
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm[request.request_id] = request
        else:
            self.waiting.add(request)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue (or fail: a grammar
        that does not compile, or earlier outputs it does not accept)."""
        for req_id in [r for r, req in self.waiting_for_fsm.items() if req.grammar and req.grammar.ready]:
            request = self.waiting_for_fsm.pop(req_id)
            assert request.grammar is not None
            error = request.grammar.finish(request.output_token_ids)
            if error is not None:
                self._fail(request, error)
                continue
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

    def _drop_fsm_wait(self, request: Request) -> bool:
        """Takes a request out of waiting_for_fsm (an abort); False when it was not there."""
        if self.waiting_for_fsm.pop(request.request_id, None) is None:
            return False
        if request.grammar is not None:
            request.grammar.cancel()
        return True

    def constrained_samplers(self, num_scheduled: dict[str, int]) -> list[str]:
        """Scheduled requests with a grammar whose step samples (reaches their last token), in
        batch order. Called before num_computed_tokens advances."""
        out = []
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            if (request.grammar is not None and request.grammar.matcher is not None
                    and request.num_computed_tokens + n >= request.num_tokens):
                out.append(req_id)
        return out

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> str | None:
        """Moves the request's matcher over its new tokens; an error text when one is refused,
        else None. The bitmask only allows what the grammar accepts, so a refused token means
        the request's own masks, applied after it, left no token to sample."""
        grammar = request.grammar
        if grammar is None or grammar.matcher is None:
            return None
        if not grammar.matcher.accept_tokens(token_ids):
            return _refusal(request, token_ids)
        return None

    @staticmethod
    def _grammar_ended(request: Request) -> bool:
        """After check_stop (length limits first, as vLLM): a grammar that ended (its stop token
        accepted, even under ignore_eos) stops the request."""
        grammar = request.grammar
        if grammar is None or grammar.matcher is None or not grammar.matcher.is_terminated():
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        return True


def _refusal(request: Request, token_ids: list[int]) -> str:
    params = request.sampling_params
    text = f"structured outputs: the grammar refused sampled token(s) {token_ids}: no token was left"
    if request.num_output_tokens - len(token_ids) < params.min_tokens:
        return (f"{text} (min_tokens={params.min_tokens} forbids the stop token, which may have "
                f"been the only one the grammar allowed)")
    if params.allowed_token_ids is not None:
        return f"{text} (allowed_token_ids holds none of the tokens the grammar allowed)"
    return text
