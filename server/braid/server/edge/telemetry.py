"""One SERVER span per braid call (opentelemetry-instrumentation-grpc's), and its duration by status
code in the metrics.

The library's interceptor makes the span, a child of the caller's W3C trace context (`traceparent`
metadata), and makes it current for the handler; the servicer adds the session's life to it
(telemetry/tracing.py). Installed only when telemetry is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from braid.server.edge.calls import wrap_calls
from braid.server.telemetry.metrics import RPC_STATUS_CODE, record_call
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import service_prefix


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    """Traces every braid call and records its duration by status code. Health checks and
    reflection are left out (a load balancer's probes would drown the traces)."""

    def __init__(self) -> None:
        self._tracing = aio_server_interceptor(filter_=service_prefix("braid."))

    async def intercept_service(self, continuation, handler_call_details):
        async def observed(details):
            handler = await continuation(details)
            if handler is None or not details.method.startswith("/braid."):
                return handler
            method = details.method.removeprefix("/")
            return wrap_calls(handler, lambda request, context: _observe(method, context))

        return await self._tracing.intercept_service(observed, handler_call_details)


@contextlib.asynccontextmanager
async def _observe(method: str, context: grpc.aio.ServicerContext):
    """Inside the library's span: the call's status code on it, as the handler ends (before the
    span does), and the call's duration once grpc says the call is done."""
    started = time.perf_counter()
    span = trace.get_current_span()
    ended: grpc.StatusCode | None = None  # how the handler ended; None while it runs, or if grpc dropped it

    def done(call: grpc.aio.ServicerContext) -> None:
        record_call(method, (call.code() or ended or _cancelled(call)).name, time.perf_counter() - started)

    context.add_done_callback(done)
    code = grpc.StatusCode.UNKNOWN  # an exception grpc answers as UNKNOWN
    try:
        yield
        code = grpc.StatusCode.OK
    except grpc.aio.AbortError:  # its code is the context's
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except (asyncio.CancelledError, GeneratorExit):  # the client went away, or the deadline passed
        code = _cancelled(context)
        raise
    finally:
        ended = code
        span.set_attribute(RPC_STATUS_CODE, code.name)


def _cancelled(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
