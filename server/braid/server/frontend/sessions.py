"""A call's sessions, as every front end handles them: cancelled with the call however it ends,
and the batches of n samples merged into one stream of (index, handle, batch). The gRPC servicer and
the HTTP front end both use these."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator

from braid.server.frontend.lanes import TokenizerLanes
from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import EmbeddingRequest, Event, FinishReason, GenerationRequest

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient

_CLOCK_SLACK_S = 0.1


async def merged(handles: list[SessionHandle]) -> AsyncIterator[tuple[int, SessionHandle, list[Event]]]:
    """(index, handle, batch) from every handle's batches, as they come. Each handle's next batch
    is taken only once the caller has written its last (its generator resumes after the yield), so
    a slow client holds every sample back, as it holds one."""
    if len(handles) == 1:
        async for batch in handles[0].batches():
            yield 0, handles[0], batch
        return
    ready: asyncio.Queue[tuple[int, SessionHandle, list[Event], asyncio.Event] | None] = asyncio.Queue()

    async def pump(index: int, handle: SessionHandle) -> None:
        async for batch in handle.batches():
            written = asyncio.Event()
            await ready.put((index, handle, batch, written))
            await written.wait()
        await ready.put(None)

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        running = len(tasks)
        while running:
            item = await ready.get()
            if item is None:
                running -= 1
                continue
            index, handle, batch, written = item
            yield index, handle, batch
            written.set()
    finally:
        for task in tasks:
            task.cancel()


def cancel_reason(req: GenerationRequest | EmbeddingRequest) -> FinishReason:
    """A call that ends before its session: DEADLINE once its deadline has passed, else CANCELLED.
    (the cancellation can arrive a hair before our own clock reaches the deadline)"""
    deadline_passed = req.deadline is not None and time.monotonic() >= req.deadline - _CLOCK_SLACK_S
    return FinishReason.DEADLINE if deadline_passed else FinishReason.CANCELLED


class CallSessions:
    """A Stream call's sessions, cancelled with the call however and whenever it ends. Made before
    any session can exist, and told of each on the event loop, as `end` is: so whichever comes
    first, the call's end or its sessions, every session is cancelled, with no window between the
    two (under load a reset stream once left its session running to max_new_tokens)."""

    def __init__(self, req: GenerationRequest | EmbeddingRequest) -> None:
        self._req = req
        self._handles: list[SessionHandle] = []
        self._ended = False

    def adopt(self, handles: list[SessionHandle]) -> None:
        self._handles.extend(handles)
        if self._ended:
            self._cancel()

    def end(self, *_: object) -> None:
        """The call is over (any arguments: grpc's done callback passes the context)."""
        self._ended = True
        self._cancel()

    def _cancel(self) -> None:
        reason = cancel_reason(self._req)
        for h in self._handles:
            h.cancel(reason)  # a no-op once finished


async def submit(
    engine: EngineClient, lanes: TokenizerLanes, req: GenerationRequest, call: CallSessions
) -> list[SessionHandle]:
    """Admits the request, compiles its constraint and queues its sessions, the blocking parts in
    the lanes' threads; `call` adopts the sessions the moment they exist."""
    # The place in the queue is taken here, before the call waits for a compile or a tokenizer thread.
    ticket = engine.admit(
        req.prompt, req.messages, truncated=req.params.truncate_input_tokens > 0, token_ids=req.prompt_token_ids
    )
    try:
        matcher = await lanes.compile(engine.compile, req) if req.constraint else None
    except BaseException:
        ticket.release()
        raise
    future = lanes.run(ticket, engine.submit, req, asyncio.get_running_loop(), matcher)

    # The call learns of its sessions on the event loop as soon as they exist, whether or not
    # this coroutine is still there to take them (cancelled while the prompt was tokenized).
    def adopt(f: asyncio.Future[list[SessionHandle]]) -> None:
        if not f.cancelled() and f.exception() is None:
            call.adopt(f.result())

    future.add_done_callback(adopt)
    return await asyncio.shield(future)
