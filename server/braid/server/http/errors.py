"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: braid's exceptions
mapped to an HTTP status, a finished session's failure raised as one, and the 404 and 405 that
Starlette answers before any route runs."""

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

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else capped(self.param)  # it may hold a client's own keys
        return {"error": {"message": capped(self.message), "type": self.kind, "param": param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


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
    return ApiError(404, "not_found_error", f"no route {request.url.path}").response()


async def not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, "invalid_request_error", f"{request.method} is not allowed on {request.url.path}").response()
