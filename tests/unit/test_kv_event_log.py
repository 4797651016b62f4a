"""The prefix cache's events (engine/kv_events.py): the ring a subscriber resumes from, the resync
when it asks for events gone or never made, and the pages' observer driven through the real
admission and core by the scripted engine harness."""

from __future__ import annotations

import asyncio

import pytest

from braid.server.config import EngineConfig, SettingError
from braid.server.engine.kv_events import KvEventLog, PageEvicted, PageStored, Resync
from braid.server.engine.pages import _key, _root
from engine_fakes import Harness, ScriptedRunner

P = 16


def _fill(log: KvEventLog, n: int) -> None:
    for i in range(n):
        log.on_evicted(bytes([i % 256]))


def test_a_subscriber_resumes_after_the_last_sequence_it_saw():
    log = KvEventLog(capacity=8)
    _fill(log, 5)
    assert [e.sequence for e in log.read(0)] == [1, 2, 3, 4, 5]
    assert [e.sequence for e in log.read(3)] == [4, 5]
    assert log.read(5) == []


def test_one_behind_the_ring_or_ahead_of_the_server_is_told_to_resync():
    log = KvEventLog(capacity=4)
    _fill(log, 10)  # the ring holds 7..10
    behind = log.read(2)
    assert behind[0] == Resync(6) and [e.sequence for e in behind[1:]] == [7, 8, 9, 10]
    assert [e.sequence for e in log.read(6)] == [7, 8, 9, 10]  # exactly the oldest held: no resync
    assert log.read(0)[0] == Resync(6)  # from the start, but the start is gone
    ahead = log.read(50)  # a sequence of another run of the server
    assert ahead[0] == Resync(6) and len(ahead) == 5
    assert len(log._ring) == 4  # bounded, however many were written


def test_a_follower_on_the_loop_is_woken_by_the_model_thread_and_resyncs_when_it_falls_behind():
    log = KvEventLog(capacity=4)

    async def follow() -> list[list[int]]:
        seen: list[list[int]] = []
        async for batch in log.follow(0):
            seen.append([e.sequence if not isinstance(e, Resync) else -e.sequence for e in batch])
            if len(seen) == 1:
                # the model thread writes while the reader is away: 6 events past a ring of 4
                await asyncio.get_running_loop().run_in_executor(None, _fill, log, 6)
            elif len(seen) == 2:
                asyncio.get_running_loop().call_later(0.01, log.on_evicted, b"x")
            else:
                log.close()
        return seen

    _fill(log, 2)
    seen = asyncio.run(asyncio.wait_for(follow(), 5))
    assert seen == [[1, 2], [-4, 5, 6, 7, 8], [9]]


def test_the_pages_report_each_full_page_stored_and_each_eviction_as_the_status_counts_them():
    """A prompt's full pages are stored once, chained from the salt's root; a second prompt that
    needs the memory evicts them; the core's cache counts agree with the events."""
    h = Harness(runner=ScriptedRunner(num_pages=6, page_size=P))
    with h:
        prompt = list(range(100, 100 + 3 * P + 4))  # three full pages and four tokens more
        h.submit(" ".join(map(str, prompt)), cache_salt="tenant", max_new_tokens=2)
        h.run()
        stored = [e for e in h.core.kv_events.read(0) if isinstance(e, PageStored)]
        assert len(stored) == 3
        root = _root("tenant")
        keys = [_key(root, prompt[:P])]
        for i in (1, 2):
            keys.append(_key(keys[-1], prompt[i * P : (i + 1) * P]))
        assert [e.key for e in stored] == keys
        assert [e.parent for e in stored] == [root, *keys[:2]]
        assert {(e.num_tokens, e.cache_salt, e.adapter_key) for e in stored} == {(P, "tenant", "")}

        other = list(range(500, 500 + 5 * P))  # five pages: two cached ones must go
        h.submit(" ".join(map(str, other)), max_new_tokens=1)
        h.run()
        events = h.core.kv_events.read(0)
        evicted = [e.key for e in events if isinstance(e, PageEvicted)]
        assert len(evicted) >= 2 and set(evicted) <= set(keys)
        stats = h.books.snapshot()
        assert stats.kv_evictions == len(evicted)
        num_stored = sum(isinstance(e, PageStored) for e in events)
        assert stats.kv_pages_used == 0 and stats.kv_pages_cached == num_stored - len(evicted)
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))


def test_the_core_keeps_kv_events_buffer_events_a_positive_count():
    with pytest.raises(SettingError, match="--kv-events-buffer 0: must be positive"):
        EngineConfig(kv_events_buffer=0)
    h = Harness(runner=ScriptedRunner(num_pages=6, page_size=P), kv_events_buffer=2)
    with h:
        h.submit(" ".join(map(str, range(100, 100 + 3 * P))), max_new_tokens=1)  # three pages stored
        h.run()
        events = h.core.kv_events.read(0)
    assert events[0] == Resync(1) and [e.sequence for e in events[1:]] == [2, 3]
