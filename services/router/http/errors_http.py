"""The app's exception handlers: every error a client sees is in OpenAI's format, a validation
error a 400 naming the field as OpenAI writes it (`messages[2].content`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.errors import OpenAIError, field_path

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def is_union_tag(part: object) -> bool:
    """Pydantic names the union member tried in an error's location (`str`, `list[int]`,
    `constrained-str`): not a field (field names are identifiers)."""
    text = str(part)
    return isinstance(part, str) and ("[" in text or "-" in text or text in _TYPE_TAGS
                                      or text[:1].isupper())


def validation_error(e: RequestValidationError | list[dict[str, object]], skip: int = 1) -> OpenAIError:
    """The 400 of a body that does not validate: its first error, the field named (the first
    `skip` parts of its location are FastAPI's `body`)."""
    errors = e.errors() if isinstance(e, RequestValidationError) else e
    first = dict(errors[0]) if errors else {}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        detail = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return OpenAIError(400, f"malformed JSON body: {detail}")
    loc = first.get("loc", ())
    parts = list(loc)[skip:] if isinstance(loc, list | tuple) else []
    param = field_path(p for p in parts if not is_union_tag(p)) or None
    msg = str(first.get("msg", "invalid value"))
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail)).response()
