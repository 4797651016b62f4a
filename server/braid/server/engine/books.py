"""The engine's books: how many sessions are queued, running and finished, read by every thread.

Every session the engine accepts is counted once in `submitted`, and from then on is exactly one of
queued, active or finished (under one finish reason):

    submitted == queued + active + sum(finished)

`queued` is derived from that identity rather than counted, so no path can leak it. Calls still
being tokenized hold a *reservation*: they count against --max-queued (a flood of big prompts is
refused at the door, before anyone tokenizes them), but are not sessions yet. Calls with big texts
may hold at most half the places, so a flood of them never shuts small calls out.
"""

from __future__ import annotations

import threading
from typing import Callable

from braid.server.engine.types import EngineStats, FinishReason, Overloaded

RETRY_AFTER_S = 1.0
BIG_TEXT_BYTES = 16 * 1024  # a big text: about 4,000 tokens, tens of milliseconds to tokenize


class Books:
    def __init__(self, max_queued: int, on_change: Callable[[], None] = lambda: None) -> None:
        """on_change: called (on the changing thread, outside the lock) after a call or a session
        leaves the books, so a waiter on `is_idle` learns of it at once, with no polling."""
        self.max_queued = max_queued
        self._on_change = on_change
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._reserved = 0  # calls admitted and being tokenized (Stream and Tokenize alike)
        self._reserved_big = 0  # of those, calls with big texts

    # ---- the threads that admit calls -------------------------------------------------------

    def reserve(self, big: bool = False) -> None:
        """Takes a place for a call about to be tokenized; Overloaded when there is none (for a
        big text: when big texts already hold half the places)."""
        with self._lock:
            queued = self._queued()
            if queued + self._reserved >= self.max_queued:
                raise Overloaded(
                    f"{queued} sessions are queued and {self._reserved} calls are being "
                    f"tokenized (--max-queued {self.max_queued})",
                    retry_after_s=RETRY_AFTER_S,
                )
            if big and self._reserved_big >= max(1, self.max_queued // 2):
                raise Overloaded(
                    f"{self._reserved_big} calls with texts over {BIG_TEXT_BYTES // 1024} KiB are being "
                    f"tokenized, half of --max-queued {self.max_queued}",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._reserved += 1
            self._reserved_big += big

    def release(self, submitted: int, big: bool = False) -> None:
        """Gives a reservation back: the call became `submitted` queued sessions (n samples), or
        none (a Tokenize call, or a prompt refused once tokenized)."""
        with self._lock:
            self._reserved -= 1
            self._reserved_big -= big
            self._stats.sessions_submitted += submitted
        self._on_change()

    # ---- the model thread -------------------------------------------------------------------

    def set_running(self, active: int, paused: int, cache: dict[str, int] | None = None) -> None:
        """Once per step: the sessions running now, and the KV cache's totals and pages (EngineStats'
        prompt_tokens_cached, preemptions, kv_* fields)."""
        with self._lock:
            self._stats.sessions_active, self._stats.sessions_paused = active, paused
            self._set_cache(cache)

    def count_pass(self, prompt_tokens: int, generated_tokens: int, proposed: int = 0, accepted: int = 0) -> None:
        """One forward pass; proposed, accepted: the speculative proposals it verified, and confirmed."""
        with self._lock:
            self._stats.forward_passes += 1
            self._stats.prompt_tokens += prompt_tokens
            self._stats.tokens_generated += generated_tokens
            self._stats.speculative_proposed_tokens += proposed
            self._stats.speculative_accepted_tokens += accepted

    def finish(self, reason: FinishReason, active: int, cache: dict[str, int] | None = None) -> None:
        """One session ended; `active`: the sessions running now that it has left; `cache`: the KV
        cache's pages now that it has released its own (as in set_running)."""
        with self._lock:
            self._stats.finished[reason] += 1
            self._stats.sessions_active = active
            self._set_cache(cache)
        self._on_change()

    def _set_cache(self, cache: dict[str, int] | None) -> None:
        """The KV cache's totals and pages (EngineStats' fields of those names); under the lock."""
        for name, value in (cache or {}).items():
            setattr(self._stats, name, value)

    # ---- anyone -----------------------------------------------------------------------------

    def _queued(self) -> int:
        s = self._stats
        return s.sessions_submitted - s.sessions_active - sum(s.finished.values())

    def snapshot(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(
                sessions_active=s.sessions_active,
                sessions_queued=self._queued(),
                sessions_paused=s.sessions_paused,
                sessions_submitted=s.sessions_submitted,
                tokens_generated=s.tokens_generated,
                prompt_tokens=s.prompt_tokens,
                forward_passes=s.forward_passes,
                finished=dict(s.finished),
                prompt_tokens_cached=s.prompt_tokens_cached,
                preemptions=s.preemptions,
                kv_evictions=s.kv_evictions,
                kv_pages_total=s.kv_pages_total,
                kv_pages_used=s.kv_pages_used,
                kv_pages_cached=s.kv_pages_cached,
                kv_page_tokens=s.kv_page_tokens,
                speculative_proposed_tokens=s.speculative_proposed_tokens,
                speculative_accepted_tokens=s.speculative_accepted_tokens,
            )

    @property
    def is_idle(self) -> bool:
        """No session queued or running, and no call being tokenized."""
        with self._lock:
            return self._reserved == 0 and self._queued() == 0 and self._stats.sessions_active == 0


class Ticket:
    """A call's place among --max-queued, taken on the event loop the moment it arrives (before it
    waits for a tokenizer thread) and given back exactly once: as a submitted session, or not."""

    def __init__(self, books: Books, text_bytes: int = 0) -> None:
        self.is_big = text_bytes > BIG_TEXT_BYTES
        books.reserve(self.is_big)
        self._books: Books | None = books

    def release(self, submitted: int = 0) -> None:
        books, self._books = self._books, None
        if books is not None:
            books.release(submitted, self.is_big)
