"""The asyncio side of a session: events from the model thread, and cancellation back to it."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from braid.server.engine.types import Event, FinishReason, Finished


class SessionHandle:
    """Handed to the gRPC edge by Engine.submit. Lives on one event loop; only `deliver` and
    `cancel` may be called from other threads."""

    def __init__(self, session_id: int, request_id: str, seed: int, prompt_tokens: int,
                 loop: asyncio.AbstractEventLoop, abort: Callable[[int, FinishReason], None]) -> None:
        self.session_id = session_id
        self.request_id = request_id
        self.seed = seed
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self._abort = abort
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrived = time.monotonic()  # the session's arrival: its timings count from here
        self.finished: Finished | None = None

    def push(self, events: list[Event]) -> None:
        """Called on the handle's loop (the engine schedules it with call_soon_threadsafe)."""
        for event in events:
            self._events.put_nowait(event)

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Yields everything that has arrived since the last batch; ends after the Finished event.

        Tokens produced while the previous message was being sent are merged into one message, so
        a slow client costs fewer, larger messages rather than a growing backlog of small ones.
        """
        while self.finished is None:
            batch = [await self._events.get()]
            while not self._events.empty():
                batch.append(self._events.get_nowait())
            for event in batch:
                if isinstance(event, Finished):
                    self.finished = event
            yield batch

    def cancel(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Asks the model thread to drop the session before its next forward pass."""
        if self.finished is None:
            self._abort(self.session_id, reason)
