"""Errors become gRPC statuses in one place: an interceptor around every braid handler.

INVALID_ARGUMENT carries google.rpc.BadRequest (the field and what is wrong with it),
RESOURCE_EXHAUSTED carries google.rpc.RetryInfo, so generated clients in any language can read them.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from braid.server.engine.types import EngineUnavailable, InvalidArgument, Overloaded

_LOGGER = logging.getLogger(__name__)


def _status(code: int, message: str, *details) -> grpc.Status:
    packed = []
    for d in details:
        any_msg = any_pb2.Any()
        any_msg.Pack(d)
        packed.append(any_msg)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=packed))


def status_for(exc: Exception) -> grpc.Status:
    if isinstance(exc, InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        return _status(code_pb2.INVALID_ARGUMENT, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(exc.retry_after_s * 1000))
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc), error_details_pb2.RetryInfo(retry_delay=delay))
    if isinstance(exc, EngineUnavailable):
        return _status(code_pb2.UNAVAILABLE, str(exc))
    _LOGGER.exception("unexpected error in a handler")
    return _status(code_pb2.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


async def abort_with(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    await context.abort(status.code, status.details, status.trailing_metadata)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns braid's exceptions, raised anywhere in a handler, into their status codes."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/braid."):
            return handler
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:
                    await abort_with(context, status_for(exc))

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for response in inner_stream(request, context):
                        yield response
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:
                    await abort_with(context, status_for(exc))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler
