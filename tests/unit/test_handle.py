"""Flow control on a session's handle: a client that stops reading pauses its session, and reading
again wakes the model thread."""

from __future__ import annotations


import asyncio

from braid.server.engine.handle import MAX_UNSENT_TOKENS, SessionHandle
from braid.server.engine.types import Delta, FinishReason, Finished, Timings


def _handle(loop, wakes: list, aborts: list) -> SessionHandle:
    return SessionHandle(1, "r", 0, 3, loop, lambda sid, reason: aborts.append((sid, reason)), lambda: wakes.append(1))


def _finished() -> Finished:
    return Finished(FinishReason.MAX_TOKENS, 3, 0, Timings(0, 0, 0, 0))


def test_backlog_pauses_and_reading_wakes_the_model_thread():
    async def run():
        wakes, aborts = [], []
        handle = _handle(asyncio.get_running_loop(), wakes, aborts)
        handle.note_emitted(MAX_UNSENT_TOKENS - 1)
        assert not handle.is_backlogged()
        handle.note_emitted(1)
        assert handle.is_backlogged()  # the model thread now leaves it out of the passes
        handle.push(Delta("x" * MAX_UNSENT_TOKENS, list(range(MAX_UNSENT_TOKENS))))
        batches = handle.batches()
        await batches.__anext__()
        assert not wakes  # taken, but not yet written to the call
        handle.push(_finished())
        await batches.__anext__()  # the first batch is written: the backlog drained
        assert wakes and not handle.is_backlogged()
        assert handle.finished is not None
        handle.cancel()  # a no-op once finished
        assert not aborts

    asyncio.run(run())


def test_no_wake_without_a_pause():
    async def run():
        wakes, aborts = [], []
        handle = _handle(asyncio.get_running_loop(), wakes, aborts)
        handle.note_emitted(2)
        assert not handle.is_backlogged()
        handle.push(Delta("ab", [5, 6]))
        handle.push(_finished())
        async for _ in handle.batches():
            pass
        assert not wakes

    asyncio.run(run())


def test_cancel_before_the_end_aborts_with_its_reason():
    async def run():
        aborts = []
        handle = _handle(asyncio.get_running_loop(), [], aborts)
        handle.cancel(FinishReason.DEADLINE)
        assert aborts == [(1, FinishReason.DEADLINE)]

    asyncio.run(run())
