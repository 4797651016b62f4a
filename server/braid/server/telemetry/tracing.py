"""A Stream session's life on its call's span: opentelemetry-instrumentation-grpc's, which the edge's
TelemetryInterceptor installs and makes current for the handler.

Until setup.py sets a tracer provider (only with an OTLP endpoint) the tracer hands out
non-recording spans, and these hooks return at once.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import Mode
from braid.server.telemetry.metrics import FINISH_REASON

def on_session(handle: SessionHandle, mode: Mode) -> None:
    """The current call's span gets its session: request id, mode, prompt tokens."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"braid.request_id": handle.request_id, "braid.mode": mode.value,
                             "braid.prompt_tokens": handle.prompt_tokens})


def on_finished(handle: SessionHandle) -> None:
    """The session's end on its span: counts, finish reason, and one event per milestone (queued,
    prefill, first_token, finish) at the engine's own times."""
    span = trace.get_current_span()
    finished = handle.finished
    if finished is None or not span.is_recording():
        return
    span.set_attributes({"braid.generated_tokens": finished.generated_tokens,
                         FINISH_REASON: finished.reason.name.lower()})
    arrived_ns = time.time_ns() - round((time.monotonic() - handle.arrived) * 1e9)
    for name, seconds in finished.milestones().items():
        span.add_event(name, timestamp=arrived_ns + round(seconds * 1e9))
