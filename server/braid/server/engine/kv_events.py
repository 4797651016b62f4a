"""The prefix cache's events, for routers that pick the replica holding a prompt's longest cached
prefix (after vLLM's distributed/kv_events.py): a page *stored* when it is named and can be shared,
*evicted* when its name is dropped for other use.

The model thread appends to a bounded ring under a lock and never waits for a reader; readers on an
event loop are woken with call_soon_threadsafe (once per wait, not once per event). A reader that
asks for events older than the ring holds, or for a sequence the server never reached (another
server's, before a restart), is told to resync: drop what it knows of this server and read on.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass(frozen=True)
class PageStored:
    """A full page named `key`: the hash of its tokens and of `parent`, the key of the page before
    it (for a prefix's first page, its root: a hash of the salt and adapter key)."""

    sequence: int
    key: bytes
    parent: bytes
    num_tokens: int
    cache_salt: str
    adapter_key: str


@dataclass(frozen=True)
class PageEvicted:
    """The page named `key` was taken back for other use: the name no longer finds it."""

    sequence: int
    key: bytes


@dataclass(frozen=True)
class Resync:
    """The events a reader asked for are gone (or were never this server's): what it knows of this
    server is stale. The events that follow it come after `sequence`."""

    sequence: int


KvEvent = PageStored | PageEvicted | Resync


class KvEventLog:
    """Sequenced events in a ring of `capacity` (--kv-events-buffer): written by the model thread
    (the pages' observer), read on event loops. Sequences start at 1 and never repeat while the
    server runs; a reader further behind than the ring resyncs."""

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._ring: deque[PageStored | PageEvicted] = deque(maxlen=capacity)
        self._last = 0  # the sequence of the newest event
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._closed = False

    # ---- the model thread (engine/pages.py's PageObserver) ------------------------------------

    def on_stored(self, key: bytes, parent: bytes, num_tokens: int, cache_salt: str, adapter_key: str) -> None:
        with self._lock:
            self._last += 1
            self._ring.append(PageStored(self._last, key, parent, num_tokens, cache_salt, adapter_key))
            waiting, self._waiting = self._waiting, []
        _wake(waiting)

    def on_evicted(self, key: bytes) -> None:
        with self._lock:
            self._last += 1
            self._ring.append(PageEvicted(self._last, key))
            waiting, self._waiting = self._waiting, []
        _wake(waiting)

    def close(self) -> None:
        """Ends every reader's iteration (the server is stopping)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
        _wake(waiting)

    # ---- any thread -------------------------------------------------------------------------

    @property
    def last_sequence(self) -> int:
        with self._lock:
            return self._last

    def read(self, after: int) -> list[KvEvent]:
        """The events held after sequence `after`; led by a Resync where some of them are gone, or
        where `after` is past the newest event (then every event held follows it)."""
        with self._lock:
            return self._read(after)

    def _read(self, after: int) -> list[KvEvent]:
        oldest = self._ring[0].sequence if self._ring else self._last + 1
        if after > self._last:
            return [Resync(self._last - len(self._ring)), *self._ring]
        if after < oldest - 1:
            return [Resync(oldest - 1), *self._ring]
        return [self._ring[-i] for i in range(self._last - after, 0, -1)]

    async def follow(self, after: int) -> AsyncIterator[list[KvEvent]]:
        """Batches of events after sequence `after` as they come, on the calling event loop; ends
        when the log is closed."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        while True:
            with self._lock:
                batch = self._read(after)
                if not batch:
                    if self._closed:
                        return
                    woken.clear()
                    self._waiting.append((loop, woken))
            if batch:
                after = batch[-1].sequence
                yield batch
            else:
                await woken.wait()


def _wake(waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, woken in waiting:
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:  # its loop has closed: nobody is reading
            pass
