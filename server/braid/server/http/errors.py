"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and on Anthropic's
routes (/v1/messages...) in Anthropic's, {"type": "error", "error": {"type", "message"}}: braid's
exceptions mapped to an HTTP status, a finished session's failure raised as one, and the 404 and
405 that Starlette answers before any route runs."""

from __future__ import annotations

import logging
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from braid.server.engine.types import EngineUnavailable, Finished, FinishReason, InvalidArgument, NotFound, Overloaded
from braid.server.frontend.errors import capped
from braid.server.http.requests import openai_error

_LOGGER = logging.getLogger("braid.server.http.app")  # the HTTP API's one logger name, in every line it writes
ANTHROPIC_ROUTES = "/v1/messages"  # the paths under it answer errors in Anthropic's shape
# Anthropic's error type for each status (its API's list); any other is invalid_request_error, or
# api_error from 500 on. A draining server's 503 is overloaded_error: Anthropic's SDK retries it.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


def error_body(status: int, kind: str, message: str, param: str | None, anthropic: bool = False) -> dict[str, Any]:
    """An error's JSON in OpenAI's shape, or in Anthropic's (whose message names the parameter)."""
    if anthropic:
        fallback = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, fallback), "message": capped(message)}}
    param = None if param is None else capped(param)  # it may hold a client's own keys
    return {"error": {"message": capped(message), "type": kind, "param": param, "code": None}}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, kind: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.headers = status, kind, message, param, headers

    @classmethod
    def of(cls, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, InvalidArgument):
            return cls(400, "invalid_request_error", str(exc), exc.field)
        if isinstance(exc, Overloaded):
            return cls(
                429, "rate_limit_error", str(exc), headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            )
        if isinstance(exc, EngineUnavailable):
            return cls(503, "service_unavailable", str(exc))
        if isinstance(exc, NotFound):  # an adapter unloaded since the request named it
            return cls(404, "not_found_error", str(exc), "model")
        _LOGGER.exception("unexpected error in an HTTP handler")
        return cls(500, "internal_error", f"internal error: {type(exc).__name__}: {exc}")

    def body(self, anthropic: bool = False) -> dict[str, Any]:
        return error_body(self.status, self.kind, self.message, self.param, anthropic)

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.body(anthropic), self.status, headers=self.headers)


def raise_failure(finished: Finished, draining: bool = False) -> None:
    """A session that failed ends its call with an error, as over gRPC (servicer._failure_status).
    So does one a draining server cancelled (its grace, or --handover-grace, over): 503, where gRPC
    ends UNAVAILABLE, so that an OpenAI client sees an error (mid-stream: an error event and no
    [DONE]), never a completion that only looks whole."""
    if finished.reason is FinishReason.CANCELLED and draining:
        raise ApiError(
            503,
            "service_unavailable",
            f"the server is draining: this generation was cut after {finished.generated_tokens} tokens; "
            "send it again to another replica",
        )
    if finished.reason is FinishReason.ERROR:
        raise ApiError(500, "internal_error", finished.error or "the engine failed")
    if finished.reason is FinishReason.INVALID_REQUEST:
        raise openai_error(
            InvalidArgument(finished.error_field or "request", finished.error or "cannot be carried out")
        )


async def not_found(request: Request, exc: Exception) -> Response:
    path = request.url.path
    return ApiError(404, "not_found_error", f"no route {path}").response(is_anthropic(path))


async def not_allowed(request: Request, exc: Exception) -> Response:
    path = request.url.path
    return ApiError(405, "invalid_request_error", f"{request.method} is not allowed on {path}").response(
        is_anthropic(path)
    )
