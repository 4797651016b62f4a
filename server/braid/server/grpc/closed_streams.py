"""Two libraries' ERROR logs for a stream whose client closed it while grpc's send waited (on flow
control: a client that reads slowly, then goes), dropped. Nothing failed but the client's wish to
read on: the call ends CANCELLED, its span with that code (tracing.py), its session freed, and the
request log says so. Each of them logged a traceback for every such call, in a log an operator reads
for real errors. Written by hand because neither library can be told not to; each filter matches
only its own case, and any other error from the same loggers is still logged.
"""

from __future__ import annotations

import logging
from types import TracebackType

# opentelemetry-instrumentation-grpc's stream layer holds its span current across its yields (a
# `with` block). grpc leaves a stream it cancelled in its own send suspended, and asyncio closes it
# later in a task of its own, where resetting the handler's context fails: "Failed to detach
# context", a ValueError raised while the layer's generator exits. The span has ended by then, its
# code on it. Upstream: open-telemetry/opentelemetry-python-contrib#2357 (open).
_OTEL_LOGGER = "opentelemetry.context"
_OTEL_STREAM_LAYER = "opentelemetry.instrumentation.grpc._aio_server"

# grpc's own: the send it was waiting in fails once the client has gone ("ExecuteBatchError raised
# in core by servicer method [...]"), logged before grpc notices the call was cancelled.
_GRPC_LOGGER = "grpc._cython.cygrpc"
_GRPC_MESSAGE = "ExecuteBatchError raised in core by servicer method"


class _ClosedStreamNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.name == _OTEL_LOGGER:
            exiting = getattr(error, "__context__", None)
            return not (
                isinstance(error, ValueError)
                and isinstance(exiting, GeneratorExit)
                and _raised_in(exiting.__traceback__, _OTEL_STREAM_LAYER)
            )
        if record.name == _GRPC_LOGGER:
            return not (type(error).__name__ == "ExecuteBatchError" and record.getMessage().startswith(_GRPC_MESSAGE))
        return True


def _raised_in(traceback: TracebackType | None, module: str) -> bool:
    while traceback is not None:
        if traceback.tb_frame.f_globals.get("__name__") == module:
            return True
        traceback = traceback.tb_next
    return False


_FILTER = _ClosedStreamNoise()


def quiet_closed_streams() -> None:
    """Installs the filter on the two loggers (once: a filter already there is not added again)."""
    for name in (_OTEL_LOGGER, _GRPC_LOGGER):
        logging.getLogger(name).addFilter(_FILTER)
