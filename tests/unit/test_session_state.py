"""Per-feature state lives with the component that owns the feature, keyed by session (engine/session.py):
the constraints' matchers, the reasonings, the speculator's, the output's queue reports, the
scheduler's paused sessions. Each holds a session's entry while it runs and frees it when it ends,
however it ends: finished, cancelled (running, paused, or queued), preempted then finished, past its
deadline, or failed in a pass. The Harness checks after every step that no component keeps state for
a session that has ended (EngineCore.leftovers); these check that the components did hold state,
and are empty at the end."""

from __future__ import annotations

import pytest

from braid.server.engine.types import FinishReason, Message, Queued
from engine_fakes import Harness, ScriptedRunner
from test_reasoning_engine import END, START, RecordingMatcher, ReasoningTokenizer


def _chat(first: int, length: int) -> list[Message]:
    """A chat whose prompt ends inside a reasoning: `length` tokens from `first`, then START."""
    return [Message("user", " ".join(str(first + i) for i in range(length - 1)) + f" {START}")]


def _model(failing: bool = False):
    """Writes 50 after every token (so n-gram proposals are confirmed), END after START; with
    `failing`, a pass that feeds a 7th generated 50 fails."""

    def next_token(row) -> int:
        if failing and list(row.history[-7:]) == [50] * 7:
            raise RuntimeError("boom")
        return END if row.token_ids[-1] == START else 50

    return next_token


def _harness(failing: bool = False, **config) -> Harness:
    runner = ScriptedRunner(num_pages=config.pop("num_pages", 64), page_size=16, next_token=_model(failing))
    return Harness(runner, tokenizer=ReasoningTokenizer(), speculative="ngram", **{"mode": "continuous", **config})


def _submit(h: Harness, first: int = 100, length: int = 20, **params) -> list:
    """A session with every feature: a constraint, a reasoning (a budget of 2), speculation."""
    params = {"max_new_tokens": 30, "max_reasoning_tokens": 2, "report_queue": True, **params}
    return h.submit("", messages=_chat(first, length), matcher=RecordingMatcher(), **params)


def _run(h: Harness, steps: int | None = None) -> set[str]:
    """Steps until no session is left (or `steps` steps); the components that held state meanwhile."""
    held: set[str] = set()
    for _ in range(steps if steps is not None else 10_000):
        if not h.core.sessions:
            break
        h.step()
        held |= {name for name, ids in h.core.kept().items() if ids}
    return held


def _all_freed(h: Harness) -> None:
    assert not h.core.sessions
    assert h.core.kept() == {name: set() for name in ("constraints", "reasonings", "speculator", "output", "paused")}


FEATURES = {"constraints", "reasonings", "speculator"}


def test_a_finished_sessions_state_is_freed():
    with _harness() as h:
        handles = _submit(h, n=2)
        assert FEATURES - {"speculator"} <= {name for name, ids in h.core.kept().items() if ids}  # from its add
        assert _run(h) >= FEATURES
        assert all(h.finished(x).reason is FinishReason.MAX_TOKENS for x in handles)
        assert all(h.finished(x).reasoning_tokens > 0 and h.finished(x).accepted_tokens > 0 for x in handles)
        _all_freed(h)


def test_a_cancelled_sessions_state_is_freed_running_paused_or_queued():
    with _harness(max_sessions=1) as h:
        running, queued = _submit(h)[0], _submit(h, first=300)[0]
        held = _run(h, steps=6)
        assert "output" in held and any(isinstance(e, Queued) for e in h.events[queued.session_id])
        h.abort(queued, FinishReason.CANCELLED)  # while it waits, its queue position reported
        running.is_backlogged = lambda: True  # its client stops reading: it sits out the passes
        held |= _run(h, steps=3)
        assert "paused" in held and held >= FEATURES
        h.abort(running, FinishReason.CANCELLED)  # while paused
        _all_freed(h)
        assert h.finished(running).reason is h.finished(queued).reason is FinishReason.CANCELLED


def test_a_preempted_sessions_state_is_kept_until_it_ends_and_then_freed():
    # 8 pages of 16 tokens; two sessions of 40 + 30 tokens need 5 pages each: one is preempted
    with _harness(num_pages=8, prefix_caching="off") as h:
        a, b = _submit(h, first=100, length=40), _submit(h, first=300, length=40)
        assert _run(h) >= FEATURES
        assert h.books.snapshot().preemptions >= 1
        assert h.finished(a[0]).reason is h.finished(b[0]).reason is FinishReason.MAX_TOKENS
        _all_freed(h)


def test_a_session_past_its_deadline_has_its_state_freed():
    with _harness() as h:
        (handle,) = _submit(h, deadline=h.now + 0.006)
        assert _run(h) >= FEATURES
        assert h.finished(handle).reason is FinishReason.DEADLINE
        _all_freed(h)


@pytest.mark.parametrize("mode", ["sequential", "continuous"])
def test_a_session_whose_pass_fails_has_its_state_freed(mode):
    with _harness(failing=True, mode=mode) as h:
        handles = _submit(h) + _submit(h, first=300)
        assert _run(h) >= FEATURES
        assert all(h.finished(x).reason is FinishReason.ERROR for x in handles)
        _all_freed(h)
