"""One SERVER span per braid call, and its duration by status code in the metrics.

The span is a child of the caller's W3C trace context (`traceparent` metadata); the servicer adds
the session's life to it (telemetry/tracing.py). Installed only when telemetry is on.
"""

from __future__ import annotations

import contextlib
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from braid.server.edge.calls import wrap_calls
from braid.server.telemetry.metrics import RPC_METHOD, RPC_STATUS_CODE, record_call

# The codes that make a server span an error, as the OpenTelemetry conventions for gRPC say.
_SERVER_ERRORS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    """Traces every braid call and records its duration by status code. Health checks and
    reflection are left out (a load balancer's probes would drown the traces)."""

    def __init__(self) -> None:
        self._tracer = trace.get_tracer("braid.server")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/braid."):
            return handler
        method = handler_call_details.method.removeprefix("/")
        parent = propagate.extract(dict(handler_call_details.invocation_metadata or ()))
        return wrap_calls(handler, lambda request, context: self._observe(method, parent, context))

    @contextlib.asynccontextmanager
    async def _observe(self, method: str, parent, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        span = self._tracer.start_span(method, parent, kind=trace.SpanKind.SERVER,
                                       attributes={"rpc.system.name": "grpc", RPC_METHOD: method})
        # The span is current for the rest of this call's task (grpc.aio gives each call its own),
        # so the servicer can add to it, and it ends when grpc says the call is done: a cancelled
        # call's generator may be dropped and closed much later, from another context.
        otel_context.attach(trace.set_span_in_context(span, parent))
        handler_code = None  # how the handler itself ended; None if grpc dropped it (cancelled)

        def end(done: grpc.aio.ServicerContext) -> None:
            code = done.code() or handler_code or _cancelled(done)
            span.set_attribute(RPC_STATUS_CODE, code.name)
            if code in _SERVER_ERRORS:
                span.set_status(trace.StatusCode.ERROR, done.details() or code.name)
            span.end()
            record_call(method, code.name, time.perf_counter() - started)

        context.add_done_callback(end)
        try:
            yield
            handler_code = grpc.StatusCode.OK
        except grpc.aio.AbortError:  # its code is the context's
            raise
        except Exception as exc:  # grpc answers UNKNOWN
            handler_code = grpc.StatusCode.UNKNOWN
            span.record_exception(exc)
            raise


def _cancelled(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
