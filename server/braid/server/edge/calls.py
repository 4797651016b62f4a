"""What every braid interceptor does: run each call of a handler inside a context of its own."""

from __future__ import annotations

import contextlib
from typing import AsyncContextManager, Callable

import grpc

Around = Callable[[object, grpc.aio.ServicerContext], AsyncContextManager]


def wrap_calls(handler: grpc.RpcMethodHandler, around: Around,
               request_deserializer=None) -> grpc.RpcMethodHandler:
    """The handler with each call (unary request: braid has no other) run inside
    `async with around(request, context) as seen`; where `seen` is a function, it is given each
    response of a stream. Optionally with another request deserializer."""
    kw = dict(request_deserializer=request_deserializer or handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            async with around(request, context):
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def unary_stream(request, context):
            # Closed as soon as this generator is: grpc, cancelled while it awaits its own send, leaves
            # the handler's generators suspended, and without this each layer would be closed only
            # when the garbage collector reaches it, outer before inner. `around` ends first.
            async with contextlib.aclosing(inner_stream(request, context)) as responses:
                async with around(request, context) as seen:
                    async for response in responses:
                        if seen is not None:
                            seen(response)
                        yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    return handler
