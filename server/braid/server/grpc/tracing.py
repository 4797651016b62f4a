"""One SERVER span per braid gRPC call (opentelemetry-instrumentation-grpc's), and its duration by
status code to the call observer.

The library's interceptor makes the span, a child of the caller's W3C trace context (`traceparent`
metadata), and makes it current for the handler; the servicer adds the session's life to it
(frontend/spans.py, as the HTTP front end does to its own). The interceptor is installed only when
telemetry is on; until the root's telemetry sets a tracer provider (only with an OTLP endpoint) the
tracer hands out non-recording spans. Only OpenTelemetry's API is used here: braid's telemetry
package, the SDK and its exporters, is wired in by the composition root alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import AsyncIterator

import grpc
from braid.server.grpc.calls import Context, Continuation, Handler, wrap_calls
from braid.server.frontend.observer import CallObserver
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import service_prefix


# OpenTelemetry's attribute name (the metrics use the same one, in telemetry/metrics.py).
RPC_STATUS_CODE = "rpc.response.status_code"


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Traces every braid call and reports its duration by status code to `calls`. Health checks
    and reflection are left out (a load balancer's probes would drown the traces)."""

    def __init__(self, calls: CallObserver) -> None:
        self._tracing: grpc.aio.ServerInterceptor = aio_server_interceptor(filter_=service_prefix("braid."))
        self._calls = calls

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        method = handler_call_details.method.removeprefix("/")

        async def observed(details: grpc.HandlerCallDetails) -> Handler | None:
            handler = await continuation(details)
            if handler is None or not _braid(details.method):
                return handler
            return wrap_calls(handler, lambda request, context: _observe(method, context, self._calls))

        handler = await self._tracing.intercept_service(observed, handler_call_details)
        if handler is None or not _braid(handler_call_details.method):
            return handler
        return wrap_calls(handler, lambda request, context: _outside_span(context))


def _braid(method: str) -> bool:
    return method.startswith("/braid.")


class _Call:
    """One call as the two layers around the library's span share it: the span, once _observe runs
    inside it, and the status code it has put on it (None until then)."""

    def __init__(self) -> None:
        self.span: trace.Span | None = None
        self.code: grpc.StatusCode | None = None


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("braid_call")


@contextlib.asynccontextmanager
async def _outside_span(context: Context) -> AsyncIterator[None]:
    """Around the library's span. A stream the client closes while grpc waits in its own send is
    cancelled there, outside every handler layer; the library's layer is then closed without
    closing the one inside it (_observe), so the span would end with no status code. This layer is
    closed first, and puts the code on while the span is still open."""
    call = _Call()
    _CALL.set(call)  # the task's context, which _observe, run by the same task, reads
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        if call.code is None and call.span is not None and call.span.is_recording():
            call.code = _cancelled(context)
            call.span.set_attribute(RPC_STATUS_CODE, call.code.name)
        raise


@contextlib.asynccontextmanager
async def _observe(method: str, context: Context, calls: CallObserver) -> AsyncIterator[None]:
    """Inside the library's span: the call's status code on it, as the handler ends (before the
    span does), and the call's duration once grpc says the call is done."""
    started = time.perf_counter()
    call = _CALL.get(None) or _Call()
    call.span = span = trace.get_current_span()

    def done(context: Context) -> None:
        calls.on_call(method, (context.code() or call.code or _cancelled(context)).name, time.perf_counter() - started)

    context.add_done_callback(done)  # type: ignore[arg-type]  # grpc-stubs: a class, where any callable will do
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
        if call.code is None:  # else _outside_span has put CANCELLED on the span already
            call.code = code
            if span.is_recording():  # not once the span has ended, nor where spans are not recorded
                span.set_attribute(RPC_STATUS_CODE, code.name)


def _cancelled(context: Context) -> grpc.StatusCode:
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
