"""Bearer-token authentication: with --api-key, every call but health checks must carry it."""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc

from braid.server.grpc.calls import Context, Continuation, Handler
from braid.server.frontend.auth import bearer_matches

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes from load balancers and orchestrators


def _deny_like(handler: Handler) -> Handler:
    async def deny(request: Any, context: Context) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer <api key>` metadata"
        )

    async def deny_stream(request: Any, context: Context) -> AsyncIterator[None]:
        await deny(request, context)
        yield  # pragma: no cover - never reached, makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = api_key.encode()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._accepts(handler_call_details.invocation_metadata or ()):
            return handler
        return _deny_like(handler)

    def _accepts(self, metadata: grpc.aio.Metadata | tuple[tuple[str, str | bytes], ...]) -> bool:
        return bearer_matches([value for key, value in metadata if key == "authorization"], self._expected)
