"""What every braid interceptor does: run each call of a handler inside a context of its own."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncContextManager, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeAlias, cast

import grpc

# A call's context and a method's handler, over any request and response (braid's interceptors serve
# every method). Strings: grpc's classes are generic only in its stubs.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"  # an interceptor's next step
Seen: TypeAlias = "Callable[[Any], None]"  # given each response of a stream
Around: TypeAlias = "Callable[[Any, Context], AsyncContextManager[Seen | None]]"


def wrap_calls(handler: Handler, around: Around, request_deserializer: Callable[[bytes], Any] | None = None) -> Handler:
    """The handler with each call (unary request: braid has no other) run inside
    `async with around(request, context) as seen`; where `seen` is a function, it is given each
    response of a stream. Optionally with another request deserializer."""
    kw = dict(
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        inner = cast("Callable[[Any, Context], Awaitable[Any]]", handler.unary_unary)  # grpc-stubs: the sync API's

        async def unary_unary(request: Any, context: Context) -> Any:
            async with around(request, context):
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        # grpc-stubs type a handler's behaviours as the sync API's: grpc.aio's stream ones are async generators
        inner_stream = cast("Callable[[Any, Context], AsyncGenerator[Any, None]]", handler.unary_stream)

        async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
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
