"""Sending a call's output, and ending it the moment its client goes away: server-sent events for
a stream (`sse`, `EventStream`), and a watch on the connection while a whole response is made
(`unless_disconnected`)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from braid.server.frontend.sessions import CallSessions
from braid.server.http.errors import ApiError

if TYPE_CHECKING:
    from braid.server.http.observed import Record

T = TypeVar("T")


class Output(Protocol):
    """A call's output in its API's shape (OpenAI's: events.py; Anthropic's: anthropic_events.py; the
    Responses API's: responses_events.py)."""

    def frames(self) -> AsyncIterator[bytes]:
        """The output as server-sent events, as they come."""

    def error_frame(self, error: ApiError) -> bytes:
        """The last event of a stream that an error cuts."""

    async def whole(self) -> dict[str, Any]:
        """The output gathered into one response (not streamed)."""


def named_frame(name: str, data: dict[str, Any]) -> bytes:
    """A server-sent event with its `event:` line, as Anthropic's and the Responses API's streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sse(output: Output, record: Record, call: CallSessions) -> AsyncIterator[bytes]:
    """Server-sent events, as they come. An error after the stream has begun is sent as a last
    event, in the API's own shape."""
    try:
        async for frame in output.frames():
            yield frame
    except asyncio.CancelledError:  # the client went away: its sessions end now
        call.end()
        record.status = 499
        raise
    except Exception as exc:
        error = ApiError.of(exc)
        record.status, record.error = error.status, error
        yield output.error_frame(error)
    finally:
        call.end()
        record.done()


class EventStream(StreamingResponse):
    """A streamed response that ends the moment its client disconnects: it listens for the
    disconnect while it streams, whatever ASGI version the server speaks, and closes its body and
    calls `on_close` (which cancels the call's sessions) however it ends, a body never started
    included."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work, cancelled if the client disconnects first (a response not streamed)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(499, "client_closed_request", "the client disconnected")  # (no one reads it)
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
