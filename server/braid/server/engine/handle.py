"""The asyncio side of a session: events from the model thread, cancellation and flow control back
to it."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from braid.server.engine.types import Delta, Event, FinishReason, Finished

# Generated tokens a session may have waiting for its client before it is paused. A client that
# stops reading fills the HTTP/2 window, then this backlog; then its session leaves the forward
# passes (keeping its KV slot) until the client reads again, so it costs neither compute nor memory.
MAX_UNSENT_TOKENS = 256


class SessionHandle:
    """Handed to the gRPC edge by Engine.submit. Lives on one event loop; `push` runs there (the
    engine schedules it), `cancel`, `note_emitted` and `is_backlogged` may be called from any thread.

    Flow control uses two counters, each written by one thread only: `_emitted` (tokens the model
    thread has produced for the client) and `_sent` (tokens the edge has written to the call).
    """

    def __init__(
        self,
        session_id: int,
        request_id: str,
        seed: int,
        prompt_tokens: int,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[int, FinishReason], None],
        wake: Callable[[], None],
    ) -> None:
        self.session_id = session_id
        self.request_id = request_id
        self.seed = seed
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self._abort = abort
        self._wake = wake
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrived = time.monotonic()  # the session's arrival: its timings count from here
        self.finished: Finished | None = None
        self._emitted = 0  # model thread only
        self._sent = 0  # event loop only
        self._paused = False  # set by the model thread before it re-reads the backlog

    def push(self, event: Event) -> None:
        """Called on the handle's loop (the engine schedules it with call_soon_threadsafe)."""
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
            yield batch  # returns once the caller has written the batch to the call
            self.note_sent(sum(len(e.token_ids) for e in batch if isinstance(e, Delta)))

    def note_sent(self, num_tokens: int) -> None:
        """The client has taken num_tokens more tokens: a session paused for its backlog runs again."""
        self._sent += num_tokens
        if self._paused:
            self._wake()

    def cancel(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Asks the model thread to drop the session before its next forward pass."""
        if self.finished is None:
            self._abort(self.session_id, reason)

    # ---- the model thread -------------------------------------------------------------------

    def note_emitted(self, num_tokens: int) -> None:
        self._emitted += num_tokens

    def is_backlogged(self) -> bool:
        """True while the client has MAX_UNSENT_TOKENS or more tokens it has not taken. The flag is
        published before the backlog is read again, so a read that drains it in between always
        sees the flag and wakes the model thread: no wake-up is lost."""
        if self._emitted - self._sent < MAX_UNSENT_TOKENS:
            self._paused = False
            return False
        self._paused = True
        return self._emitted - self._sent >= MAX_UNSENT_TOKENS
