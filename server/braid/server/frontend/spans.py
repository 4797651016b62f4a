"""A session's life on its call's span, as every front end records it: the front end's own
instrumentation makes the span (grpc/tracing.py's interceptor, http/observed.py's) and makes it current;
these hooks add the session to it (`on_session`, `on_finished`). Until the root's telemetry sets a
tracer provider (only with an OTLP endpoint) spans do not record, and the hooks return at once.
Only OpenTelemetry's API is used here."""

from __future__ import annotations

import time

from opentelemetry import trace

from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import Mode

# OpenTelemetry's attribute name (the metrics use the same one, in telemetry/metrics.py).
FINISH_REASON = "braid.finish_reason"


def on_session(handle: SessionHandle, mode: Mode) -> None:
    """The current call's span gets its session: request id, mode, prompt tokens."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "braid.request_id": handle.request_id,
                "braid.mode": mode.value,
                "braid.prompt_tokens": handle.prompt_tokens,
            }
        )


def on_finished(handle: SessionHandle) -> None:
    """The session's end on its span: counts, finish reason, and one event per milestone (queued,
    prefill, first_token, finish) at the engine's own times."""
    span = trace.get_current_span()
    finished = handle.finished
    if finished is None or not span.is_recording():
        return
    span.set_attributes(
        {"braid.generated_tokens": finished.generated_tokens, FINISH_REASON: finished.reason.name.lower()}
    )
    arrived_ns = time.time_ns() - round((time.monotonic() - handle.arrived) * 1e9)
    for name, seconds in finished.milestones().items():
        span.add_event(name, timestamp=arrived_ns + round(seconds * 1e9))
