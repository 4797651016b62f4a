"""The scheduler with paused sessions: a client that does not read never holds the model."""

from __future__ import annotations

import pytest

from braid.server.engine.scheduler import Scheduler
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.types import Mode, SamplingParams


class FakeCache:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        self._free.append(slot)


def _session(i: int, prompt_len: int = 4, arrived: float = 0.0) -> Session:
    return Session(id=i, prompt_ids=list(range(1, prompt_len + 1)), params=SamplingParams(), handle=None,
                   detokenizer=None, rng=None, arrived=arrived)


def _scheduler(mode: Mode, slots: int = 4, prefill_chunk: int = 512) -> Scheduler:
    return Scheduler(mode, FakeCache(slots), max_batch_size=4, max_wait_s=0.0, prefill_chunk=prefill_chunk,
                     batch_max_wait_s=5.0)


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.BATCHED])
def test_a_paused_session_does_not_hold_back_the_next(mode):
    sched = _scheduler(mode)
    first, second = _session(1), _session(2)
    sched.add(first)
    assert [w.session for w in sched.schedule(now=1.0)] == [first]
    first.num_cached = first.num_prompt
    sched.add(second)
    assert [w.session for w in sched.schedule(now=2.0)] == [first]  # one at a time / until the batch drains
    first.paused = True
    assert [w.session for w in sched.schedule(now=3.0)] == [second]
    assert first.status is SessionStatus.RUNNING and first.slot is not None  # keeps its slot


@pytest.mark.parametrize("mode", list(Mode))
def test_paused_sessions_sit_out_every_pass(mode):
    sched = _scheduler(mode)
    sessions = [_session(i) for i in range(3)]
    for s in sessions:
        sched.add(s)
    for step in range(len(sessions)):  # sequential admits the next each time the running one pauses
        sched.schedule(now=10.0 + step)
        for s in sched.running:
            s.paused = True
    assert len(sched.running) == 3 and sched.schedule(now=20.0) == []


def test_interleaved_turns_go_round_the_runnable_sessions_only():
    sched = _scheduler(Mode.INTERLEAVED)
    sessions = [_session(i) for i in range(3)]
    for s in sessions:
        sched.add(s)
    sched.schedule(now=1.0)
    sessions[1].paused = True
    picked = {sched.schedule(now=2.0 + t)[0].session.id for t in range(6)}
    assert picked == {0, 2}


def test_a_pass_of_prompt_chunks_only_is_scheduled_whole():
    """A 600-token prompt with a 512-token chunk: the first pass feeds 512 tokens and samples
    nothing (the runner must accept a pass with no rows to sample: issue 10's INTERNAL)."""
    sched = _scheduler(Mode.SEQUENTIAL, prefill_chunk=512)
    s = _session(1, prompt_len=600)
    sched.add(s)
    [work] = sched.schedule(now=1.0)
    assert work.num_tokens == 512 and work.num_tokens < s.num_uncached
