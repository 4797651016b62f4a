"""The scheduler: paused sessions never hold the model; admission by KV-cache pages; preemption
instead of failure when the pages run out."""

from __future__ import annotations

import pytest

from braid.server.config import EngineConfig
from braid.server.engine.pages import Pages
from braid.server.engine.scheduler import Scheduler
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.types import Mode, SamplingParams


def _session(i: int, prompt_len: int = 4, arrived: float = 0.0) -> Session:
    return Session(
        id=i,
        prompt_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(),
        handle=None,
        detokenizer=None,
        rng=None,
        arrived=arrived,
    )


def _scheduler(mode: Mode, sessions: int = 4, prefill_chunk: int = 512, pages: int = 256) -> Scheduler:
    config = EngineConfig(
        mode=mode,
        max_batch_size=4,
        max_sessions=sessions,
        max_wait_ms=0.0,
        prefill_chunk=prefill_chunk,
        batch_max_wait_ms=5000.0,
    )
    return Scheduler(config, Pages(pages, page_size=16))


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.BATCHED])
def test_a_paused_session_does_not_hold_back_the_next(mode):
    sched = _scheduler(mode)
    first, second = _session(1), _session(2)
    sched.add(first)
    assert [w.session for w in sched.schedule(now=1.0)] == [first]
    first.num_cached = first.num_prompt
    sched.add(second)
    assert [w.session for w in sched.schedule(now=2.0)] == [first]  # one at a time / until the batch drains
    sched.pause(first)
    assert [w.session for w in sched.schedule(now=3.0)] == [second]
    assert first.status is SessionStatus.RUNNING and first.pages  # keeps its pages


@pytest.mark.parametrize("mode", list(Mode))
def test_paused_sessions_sit_out_every_pass(mode):
    sched = _scheduler(mode)
    sessions = [_session(i) for i in range(3)]
    for s in sessions:
        sched.add(s)
    for step in range(len(sessions)):  # sequential admits the next each time the running one pauses
        sched.schedule(now=10.0 + step)
        for s in sched.running:
            sched.pause(s)
    assert len(sched.running) == 3 and sched.schedule(now=20.0) == []


def test_interleaved_turns_go_round_the_runnable_sessions_only():
    sched = _scheduler(Mode.INTERLEAVED)
    sessions = [_session(i) for i in range(3)]
    for s in sessions:
        sched.add(s)
    sched.schedule(now=1.0)
    sched.pause(sessions[1])
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


@pytest.mark.parametrize(
    "mode, admitted", [(Mode.SEQUENTIAL, 1), (Mode.INTERLEAVED, 4), (Mode.BATCHED, 4), (Mode.CONTINUOUS, 4)]
)
def test_each_mode_admits_as_many_as_it_runs(mode, admitted):
    sched = _scheduler(mode, sessions=4)
    for i in range(6):
        sched.add(_session(i))
    work = sched.schedule(now=1.0)
    assert len(sched.running) == admitted and sched.num_waiting == 6 - admitted
    # sequential and interleaved feed one session a pass; batched and continuous all of them
    assert len(work) == (1 if mode in (Mode.SEQUENTIAL, Mode.INTERLEAVED) else admitted)


def test_continuous_shares_a_token_budget_between_prompts():
    sched = _scheduler(Mode.CONTINUOUS, prefill_chunk=512)
    long_prompt, short = _session(1, prompt_len=700), _session(2, prompt_len=100)
    sched.add(long_prompt)
    sched.add(short)
    work = sched.schedule(now=1.0)
    assert [(w.session.id, w.num_tokens) for w in work] == [(1, 512)]  # the budget is spent on the first


def test_batched_waits_for_the_batch_to_fill_or_the_wait_to_pass():
    config = EngineConfig(mode=Mode.BATCHED, max_batch_size=4, max_wait_ms=100.0)
    sched = Scheduler(config, Pages(8, page_size=16))
    sched.add(_session(1, arrived=0.0))
    assert sched.schedule(now=0.05) == [] and sched.wait_hint(now=0.05) == pytest.approx(0.05)
    assert len(sched.schedule(now=0.1)) == 1


def test_batch_priority_waits_for_interactive_but_not_for_ever():
    from braid.server.engine.types import Priority

    config = EngineConfig(mode=Mode.SEQUENTIAL, max_batch_size=1, batch_max_wait_ms=1000.0)
    sched = Scheduler(config, Pages(1, page_size=16))
    batch = _session(1, arrived=0.0)
    batch.priority = Priority.BATCH
    interactive = _session(2, arrived=0.5)
    sched.add(batch)
    sched.add(interactive)
    assert sched.schedule(now=0.6)[0].session is interactive  # interactive first
    sched.remove(interactive)
    late = _session(3, arrived=1.2)
    sched.add(late)
    assert sched.schedule(now=1.5)[0].session is batch  # waited past batch_max_wait: its turn


def _run(sched: Scheduler, now: float) -> list:
    """One step as the engine runs it: schedule, then every work item computed."""
    work = sched.schedule(now)
    for w in work:
        sched.computed(w.session, w.num_tokens)
        if not w.session.is_prefilling and w.session.num_uncached == 0:
            w.session.token_ids.append(7)  # the sampled token
    return work


@pytest.mark.parametrize("mode", list(Mode))
def test_admission_is_by_the_pages_a_session_needs_not_by_the_longest_it_may_grow(mode):
    """64 pages of 16 tokens: 40-token prompts need 3 pages each, plus one of room per running
    session, so 16 run (a slot per --max-seq-len would have fitted one)."""
    sched = _scheduler(mode, sessions=32, pages=64)
    for i in range(20):
        sched.add(_session(i, prompt_len=40))
    sched.schedule(now=1.0)
    expected = {Mode.SEQUENTIAL: 1, Mode.BATCHED: 4}.get(mode, 16)
    assert len(sched.running) == expected
    assert sched.pages.num_used == 3 * expected


def test_a_session_out_of_pages_preempts_the_newest_and_it_resumes_from_its_tokens():
    """Two sessions fill the cache; when the first needs a page, the newest is preempted: its pages
    go back, it waits at the head of the queue, and nothing fails."""
    sched = _scheduler(Mode.CONTINUOUS, pages=5)
    old, new = _session(1, prompt_len=32, arrived=0.0), _session(2, prompt_len=31, arrived=1.0)
    sched.add(old)
    sched.add(new)
    _run(sched, now=2.0)  # old: 2 pages + 1 room; new: 2 pages
    assert sched.running == [old, new] and sched.pages.num_available == 1
    _run(sched, now=3.0)  # old samples past its second page: takes the last one
    new.token_ids += [7] * 16  # new's 32 tokens fill its pages; its next one needs a page
    new.num_cached = 32 + 15
    work = sched.schedule(now=4.0)
    assert new.status is SessionStatus.WAITING and new.num_cached == 0 and new.preemptions == 1
    assert [w.session for w in work] == [old] and sched.take_preempted() == [new]
    sched.remove(old)
    assert sched.pages.num_used == 0
    sched.schedule(now=5.0)
    # readmitted: its two full pages were still cached, the rest is recomputed as one prompt
    assert new.status is SessionStatus.RUNNING and new.is_prefilling and new.num_cached == 32
    assert new.cached_tokens == 0  # what its response reports: the cache at its first admission


def test_a_batch_session_is_preempted_before_an_interactive_one():
    from braid.server.engine.types import Priority

    sched = _scheduler(Mode.CONTINUOUS, pages=5)
    batch, interactive = _session(1, prompt_len=32, arrived=0.0), _session(2, prompt_len=16, arrived=1.0)
    batch.priority = Priority.BATCH
    sched.add(batch)
    sched.add(interactive)
    _run(sched, now=2.0)
    assert interactive.status is SessionStatus.RUNNING
    while batch.status is SessionStatus.RUNNING:
        _run(sched, now=3.0)
    assert interactive.status is SessionStatus.RUNNING and batch.preemptions == 1


def test_bad_words_ban_the_token_that_would_complete_them():
    s = _session(1, prompt_len=3)  # tokens 1, 2, 3
    s.bad_words = ((9,), (3, 4), (2, 3, 5), (7, 8))
    assert sorted(s.banned_by_bad_words()) == [4, 5, 9]  # (7, 8): its 7 has not come
    s.token_ids.append(7)
    assert sorted(s.banned_by_bad_words()) == [8, 9]
