"""When a request stops on token-level conditions (stop strings are the front end's)."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets the request's finished status and returns True when its last token ends it.

    Order as in vLLM: length limits first, then nothing before `min_tokens`, then EOS (unless
    `ignore_eos`), then `stop_token_ids` (the token becomes the stop reason).
    """
    params = request.sampling_params
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - request.num_prompt_tokens
    if request.num_tokens >= max_model_len or request.num_output_tokens >= max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False
