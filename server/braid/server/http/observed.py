"""Around every HTTP call: the API key, errors in its API's shape (OpenAI's, or Anthropic's on
/v1/messages), the span, the request-log line and the call's metric. A route is a handler of (request, record); `route` wraps it in all of these."""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from opentelemetry import propagate, trace
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from braid.server.engine.types import Finished
from braid.server.frontend.auth import bearer_matches, key_matches
from braid.server.frontend.observer import CallObserver
from braid.server.frontend.request_log import echoed
from braid.server.http.errors import ApiError, is_anthropic
from braid.server.logs import FIELDS, key_values

_LOGGER = logging.getLogger("braid.server.http.app")  # the HTTP API's one logger name, in every line it writes
_TRACER = trace.get_tracer("braid.server.http")


class Record:
    """One HTTP call's request log line (as grpc/request_log.py writes gRPC's) and its metric."""

    def __init__(self, request: Request, span: trace.Span, calls: CallObserver, route: str) -> None:
        """route: the method and the route's template, which the metric is labelled with."""
        self.span = span
        self.calls = calls
        self.started = time.perf_counter()
        client = request.client
        self.template = route
        self.route = f"{request.method} {request.url.path}"
        self.peer = f"{client.host}:{client.port}" if client else ""
        self.request_id = ""
        self.user: str | None = None
        self.status = 0
        self.error: ApiError | None = None
        self.streamed = False
        self.ignored: list[str] = []  # fields of the request braid does not know
        self._finals: list[Finished] = []
        self._logged = False

    def finished(self, finished: Finished) -> None:
        self._finals.append(finished)

    def done(self) -> None:
        if self._logged:
            return
        self._logged = True
        seconds = time.perf_counter() - self.started
        self.span.set_attribute("http.response.status_code", self.status)
        self.span.end()
        self.calls.on_call("http " + self.template, str(self.status), seconds)
        level = logging.INFO if self.route.startswith("POST") else logging.DEBUG  # generations, as gRPC's Stream
        if not _LOGGER.isEnabledFor(level):
            return
        line: dict[str, object] = {
            "request_id": self.request_id or None,
            "peer": self.peer,
            "route": echoed(self.route),  # what the client wrote is echoed capped: its path, user, keys
            "status": self.status,
        }
        if self.error is not None:
            line |= {"error": self.error.kind, "param": None if self.error.param is None else echoed(self.error.param)}
        if self.user:
            line["user"] = echoed(self.user)
        if self.ignored:
            line["ignored"] = echoed(",".join(self.ignored))
        finals = self._finals
        if finals:
            line |= {
                "finish": ",".join(sorted({f.reason.name.lower() for f in finals})),
                "prompt_tokens": finals[0].prompt_tokens,
                "cached_tokens": sum(f.cached_tokens for f in finals),
                "generated_tokens": sum(f.generated_tokens for f in finals),
                "queue_ms": min(f.timings.queue_ms for f in finals),
                "ttft_ms": min(f.timings.time_to_first_token_ms for f in finals),
                "tok_s": sum(f.timings.tokens_per_second for f in finals),
            }
        line["total_ms"] = seconds * 1000
        _LOGGER.log(level, "HTTP %s", key_values(line), extra={FIELDS: line})


Handler = Callable[[Request, Record], Awaitable[Response]]


def route(path: str, handler: Handler, methods: list[str], calls: CallObserver, api_key: bytes | None) -> Route:
    """An observed route: its span and its metric are named by the route's template (OpenTelemetry's
    http.route, e.g. "GET /v1/models/{id}"), never by the path a client wrote, which would make a
    new metric series and span name of every id a client sends."""
    template = path.replace(":path}", "}")
    anthropic = is_anthropic(path)

    async def handle(request: Request) -> Response:
        # the span, a child of the caller's W3C trace context, lasts until the call's end: a
        # stream's last event, not the handler's return
        span = _TRACER.start_span(
            f"{request.method} {template}",
            kind=trace.SpanKind.SERVER,
            context=propagate.extract(request.headers),
            attributes={"http.route": template},
        )
        record = Record(request, span, calls, f"{request.method} {template}")
        with trace.use_span(span, end_on_exit=False):
            try:
                authorize(request, api_key)
                response = await handler(request, record)
            except Exception as exc:
                error = ApiError.of(exc)
                record.status, record.error = error.status, error
                record.done()
                return error.response(anthropic)
        record.status = response.status_code
        if not record.streamed:
            record.done()
        return response

    return Route(path, handle, methods=methods)


def authorize(request: Request, api_key: bytes | None) -> None:
    """With --api-key: exactly one `Authorization: Bearer <key>`, as over gRPC (frontend/auth.py),
    or exactly one `x-api-key: <key>`, as Anthropic's clients send it, on every route; a call that
    sends both must have the key in both."""
    if api_key is None:
        return
    bearer, keys = request.headers.getlist("authorization"), request.headers.getlist("x-api-key")
    matches = (not bearer or bearer_matches(bearer, api_key)) and (not keys or key_matches(keys, api_key))
    if not (bearer or keys) or not matches:
        raise ApiError(
            401, "authentication_error", "missing or wrong `Authorization: Bearer <api key>` or `x-api-key` header"
        )
