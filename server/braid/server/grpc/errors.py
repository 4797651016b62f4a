"""Errors become gRPC statuses in one place: an interceptor around every braid handler.

INVALID_ARGUMENT carries google.rpc.BadRequest (the field and what is wrong with it),
RESOURCE_EXHAUSTED carries google.rpc.RetryInfo (and grpc-retry-pushback-ms, the same delay for gRPC's
retry policy), so generated clients in any language can read them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import Message
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from braid.server.grpc.calls import Context, Continuation, Handler, wrap_calls
from braid.server.grpc.wire import invalid_utf8_field
from braid.server.engine.types import (
    AlreadyExists,
    Busy,
    EngineUnavailable,
    InvalidArgument,
    LimitReached,
    NotFound,
    Overloaded,
)
from braid.server.frontend.errors import capped

_LOGGER = logging.getLogger(__name__)


def status(code: grpc.StatusCode, message: str) -> grpc.Status:
    """A plain status: a code and its message (capped)."""
    return _status(code.value[0], message)


def with_trailers(status: grpc.Status, *pairs: tuple[str, str]) -> grpc.Status:
    """The status with these trailers added after its own."""
    # rpc_status makes each status a namedtuple that is also a grpc.Status; the stubs know only the latter
    replaced: grpc.Status = status._replace(  # type: ignore[attr-defined]
        trailing_metadata=tuple(status.trailing_metadata) + pairs
    )
    return replaced


def _status(code: int, message: str, *details: Message) -> grpc.Status:
    message = capped(message)
    packed = []
    for d in details:
        any_msg = any_pb2.Any()
        any_msg.Pack(d)
        packed.append(any_msg)
    status: grpc.Status = rpc_status.to_status(status_pb2.Status(code=code, message=message, details=packed))
    return status


# braid's exceptions that are a status code and a message, no more
_PLAIN = {
    NotFound: code_pb2.NOT_FOUND,
    AlreadyExists: code_pb2.ALREADY_EXISTS,
    LimitReached: code_pb2.RESOURCE_EXHAUSTED,
    Busy: code_pb2.FAILED_PRECONDITION,
}


def status_for(exc: Exception) -> grpc.Status:
    if isinstance(exc, InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=capped(exc.description))
        return _status(code_pb2.INVALID_ARGUMENT, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(exc.retry_after_s * 1000))
        status = _status(code_pb2.RESOURCE_EXHAUSTED, str(exc), error_details_pb2.RetryInfo(retry_delay=delay))
        # the same delay as gRPC's own retry policy reads it (server pushback), so a client with a
        # retry policy for RESOURCE_EXHAUSTED waits as long as RetryInfo asks
        pushback = (("grpc-retry-pushback-ms", str(delay.ToMilliseconds())),)
        return with_trailers(status, *pushback)
    if isinstance(exc, EngineUnavailable):
        return _status(code_pb2.UNAVAILABLE, str(exc))
    for kind, code in _PLAIN.items():
        if isinstance(exc, kind):
            return _status(code, str(exc))
    _LOGGER.exception("unexpected error in a handler")
    return _status(code_pb2.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


async def abort_with(context: Context, status: grpc.Status) -> None:
    await context.abort(status.code, status.details, status.trailing_metadata)


class _Undecodable:
    """Stands in for a request protobuf could not parse, so the handler can say why."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """Wraps a request deserializer: a bad message becomes INVALID_ARGUMENT naming the field,
    instead of grpc's bare INTERNAL 'exception deserializing request'."""
    message_type = getattr(deserializer, "__self__", None)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            descriptor = getattr(message_type, "DESCRIPTOR", None)
            field = invalid_utf8_field(data, descriptor) if descriptor is not None else None
            if field is not None:
                return _Undecodable(InvalidArgument(field, "is not valid UTF-8"))
            return _Undecodable(InvalidArgument("request", f"cannot be parsed: {exc}"))

    return parse


def _check(request: object) -> None:
    if isinstance(request, _Undecodable):
        raise request.error


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns braid's exceptions, raised anywhere in a handler, into their status codes."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_deserializer is None
            or not handler_call_details.method.startswith("/braid.")
        ):
            return handler
        return wrap_calls(handler, _as_status, request_deserializer=_lenient(handler.request_deserializer))


@contextlib.asynccontextmanager
async def _as_status(request: object, context: Context) -> AsyncIterator[None]:
    try:
        _check(request)
        yield
    except (grpc.aio.AbortError, grpc.RpcError):
        raise
    except Exception as exc:
        if context.done():  # the call is already over (e.g. its deadline passed mid-send)
            raise
        await abort_with(context, status_for(exc))
