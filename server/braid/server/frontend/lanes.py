"""The threads that tokenize calls' text, off the event loop: one lane for small texts, one for big;
and a lane of its own where calls wait for their constraints to compile.

Tokenizing a 1 MiB text takes a second or more. On one shared pool, a flood of big prompts or
Tokenize calls queued every small call behind them (a 4-token call waited 13.5 s behind 40 big
prompts). Here big texts queue only behind each other, on one thread, so they also hold one big
encoding in memory at a time; small calls keep their own threads. The tokenizer releases the GIL,
so the lanes run in parallel with each other and with the model thread.

A constraint can take seconds to compile. Compiled on the small lane, 24 big regexes held a 2-token
call up for 4.7 s; on the constraint lane, calls wait for compiles only behind other compiles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, TypeVar

from braid.server.engine.books import Ticket

T = TypeVar("T")
SMALL_THREADS = 2
CONSTRAINT_THREADS = 2  # as many as the compiler runs at once (engine/grammars.py COMPILE_THREADS)


class TokenizerLanes:
    def __init__(self) -> None:
        self._small = concurrent.futures.ThreadPoolExecutor(SMALL_THREADS, thread_name_prefix="braid-tokenize")
        self._big = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="braid-tokenize-big")
        self._constraints = concurrent.futures.ThreadPoolExecutor(
            CONSTRAINT_THREADS, thread_name_prefix="braid-constraint"
        )

    def run(self, ticket: Ticket, work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Runs work(ticket, *args) in the lane for the ticket's text (big or not). The ticket is
        given back however that ends, a call cancelled before its turn came included."""
        lane = self._big if ticket.is_big else self._small
        future = lane.submit(work, ticket, *args)
        future.add_done_callback(lambda _: ticket.release())
        return asyncio.wrap_future(future)

    def compile(self, work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Runs work(*args) in the constraint lane."""
        return asyncio.wrap_future(self._constraints.submit(work, *args))

    def shutdown(self) -> None:
        for lane in (self._small, self._big, self._constraints):
            lane.shutdown(wait=False, cancel_futures=True)
