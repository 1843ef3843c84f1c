"""OpenAI endpoints for other kinds of model (embeddings, audio, images, ...): each answers a
400 in OpenAI's error format saying what this server serves, instead of a bare 404."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.router.errors import OpenAIError

ENDPOINTS = ("/v1/embeddings", "/v1/audio/transcriptions", "/v1/audio/translations",
             "/v1/audio/speech", "/v1/images/generations", "/v1/moderations",
             "/v1/rerank", "/v1/score", "/pooling", "/classify")


def endpoints_router() -> APIRouter:
    """POST on each of ENDPOINTS: a 400 in OpenAI's error format saying what this server serves."""
    router = APIRouter()

    def refuse(path: str) -> Callable[[], Awaitable[JSONResponse]]:
        async def endpoint() -> JSONResponse:
            return OpenAIError(400, f"{path} is not supported by this server: it serves a generative "
                                    f"model on /v1/completions, /v1/chat/completions and "
                                    f"/v1/responses",
                               code="unsupported_endpoint").response()
        return endpoint

    for path in ENDPOINTS:
        router.add_api_route(path, refuse(path), methods=["POST"], include_in_schema=False)
    return router
