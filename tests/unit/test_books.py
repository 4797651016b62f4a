"""The engine's books: every session counted once, queued derived, reservations at the door."""

from __future__ import annotations

import pytest

from braid.server.engine.books import BIG_TEXT_BYTES, Books, Ticket
from braid.server.engine.types import FinishReason, Overloaded


def _identity_holds(books: Books) -> bool:
    s = books.snapshot()
    return s.sessions_submitted == s.sessions_queued + s.sessions_active + sum(s.finished.values())


def test_a_session_is_queued_then_active_then_finished_and_counted_once():
    books = Books(max_queued=4)
    Ticket(books).release(submitted=True)
    assert books.snapshot().sessions_queued == 1 and _identity_holds(books)
    books.set_running(active=1, paused=0)
    assert books.snapshot().sessions_queued == 0 and _identity_holds(books)
    books.finish(FinishReason.CANCELLED, active=0)
    s = books.snapshot()
    assert (s.sessions_queued, s.sessions_active, s.finished[FinishReason.CANCELLED]) == (0, 0, 1)
    assert _identity_holds(books) and books.is_idle


def test_a_session_admitted_then_cancelled_before_its_first_pass_leaves_the_queue():
    """The leak of issue 10: a session given a slot but cancelled before its first forward pass was
    never subtracted from the queued count, until every call was refused."""
    books = Books(max_queued=2)
    for _ in range(10):
        Ticket(books).release(submitted=True)
        books.set_running(active=1, paused=0)  # admitted: holds a slot, has not run yet
        books.finish(FinishReason.CANCELLED, active=0)
    assert books.snapshot().sessions_queued == 0
    Ticket(books).release()  # and a new call still gets in


def test_calls_being_tokenized_count_against_max_queued():
    books = Books(max_queued=2)
    first, second = Ticket(books), Ticket(books)
    with pytest.raises(Overloaded) as err:
        Ticket(books)
    assert "2 calls are being tokenized" in str(err.value) and err.value.retry_after_s > 0
    first.release(submitted=True)
    second.release()  # a Tokenize call, or a prompt refused once tokenized: never a session
    s = books.snapshot()
    assert (s.sessions_submitted, s.sessions_queued) == (1, 1)
    assert not books.is_idle


def test_a_ticket_is_given_back_once_however_often_it_is_released():
    books = Books(max_queued=1)
    ticket = Ticket(books)
    ticket.release(submitted=True)
    ticket.release()
    ticket.release(submitted=True)
    assert books.snapshot().sessions_submitted == 1
    books.finish(FinishReason.EOS, active=0)
    Ticket(books)  # the one place is free again


def test_big_texts_hold_at_most_half_the_places():
    """A flood of big prompts or Tokenize texts must not shut small calls out (issue 10)."""
    books = Books(max_queued=4)
    big = [Ticket(books, text_bytes=BIG_TEXT_BYTES + 1) for _ in range(2)]
    with pytest.raises(Overloaded, match="half of --max-queued 4"):
        Ticket(books, text_bytes=BIG_TEXT_BYTES + 1)
    small = [Ticket(books, text_bytes=10) for _ in range(2)]  # small calls still get in
    with pytest.raises(Overloaded):
        Ticket(books, text_bytes=10)
    big[0].release()
    Ticket(books, text_bytes=BIG_TEXT_BYTES + 1)
    for ticket in small:
        ticket.release()
