"""OpenAI error responses of the router, and what a failed worker call becomes for a client."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse

from services.router.api.openai_models import error_body
from services.router.dispatch.dispatcher import NoWorkerError
from services.worker.client import WorkerError


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def body(self) -> dict[str, object]:
        type_ = {401: "authentication_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return error_body(printable(self.message) or "", type_, printable(self.param), self.code)


def printable(text: str | None) -> str | None:
    """`text` with lone surrogates escaped (a client's invalid UTF-16 quoted back in an error
    message would make the JSON body unencodable: a 500 instead of the 400)."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def field_path(loc: Iterable[str | int]) -> str:
    """A field's name as OpenAI writes it in an error's `param`: `messages[2].tool_call_id`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def from_dispatch(error: WorkerError | NoWorkerError, retry_after_s: int) -> OpenAIError:
    """A worker call's failure as the client sees it: 400 for a request the worker refused, 504
    for a timeout, else 503 (retry later)."""
    if isinstance(error, NoWorkerError):
        return OpenAIError(503, f"{error}; retry later", code="worker_unavailable",
                           headers={"Retry-After": str(retry_after_s)})
    if error.kind == "invalid":
        message = error.message.split(": ", 1)[-1]
        first = message.split(" ", 1)[0].rstrip(":")  # the workers' messages start with the field
        param = first if first.isidentifier() and first.islower() else None
        return OpenAIError(400, message, param)
    if error.kind == "timeout":
        return OpenAIError(504, "the worker timed out", code="timeout")
    return OpenAIError(503, f"worker unavailable: {error.message}", code="worker_unavailable",
                       headers={"Retry-After": str(retry_after_s)})
