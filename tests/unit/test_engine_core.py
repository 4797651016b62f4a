"""The engine core (engine/core.py) stepped in process with a scripted runner: every mode's
schedule, stop rules, cancellation, deadlines, n, resume, preemption and the books, in
milliseconds and with no model, no thread and no server."""

from __future__ import annotations

import pytest

from braid.server.engine.handle import MAX_UNSENT_TOKENS
from braid.server.engine.types import FinishReason
from engine_fakes import EOS, Harness, ScriptedRunner


MODES = ("sequential", "interleaved", "batched", "continuous")


@pytest.fixture
def harness():
    made = []

    def make(**kw) -> Harness:
        made.append(Harness(**kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_each_session_its_own_tokens_and_balances_the_books(harness, mode):
    h = harness(mode=mode, max_batch_size=4)
    handles = [h.submit(f"{10 * i} {10 * i + 1}", max_new_tokens=5)[0] for i in range(1, 4)]
    h.run()
    for i, handle in enumerate(handles, start=1):
        start = 10 * i + 2
        assert h.tokens(handle) == list(range(start, start + 5))
        assert h.finished(handle).reason is FinishReason.MAX_TOKENS
    stats = h.books.snapshot()
    assert stats.finished[FinishReason.MAX_TOKENS] == 3 and stats.sessions_active == 0 and stats.sessions_queued == 0
    assert h.core.pages.num_used == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_client_that_stops_reading_is_paused_costs_the_others_nothing_and_resumes(harness, mode):
    """In every mode (test_adversarial's client that stops reading, over the wire, runs in one): a
    session whose client reads nothing is paused once MAX_UNSENT_TOKENS are waiting for it, holds
    its slot but generates nothing more, lets another session run to its end, and runs on to its
    own end once its client reads."""
    h = harness(mode=mode, max_batch_size=4)
    max_new_tokens = MAX_UNSENT_TOKENS + 100  # within the harness's context (512)
    [unread] = h.submit("5", max_new_tokens=max_new_tokens, ignore_eos=True)
    h.stop_reading(unread)
    for _ in range(max_new_tokens):
        h.step()
        if h.core.scheduler.paused:
            break
    assert h.core.scheduler.paused == {unread.session_id}
    generated = len(h.tokens(unread))
    assert generated == MAX_UNSENT_TOKENS
    [other] = h.submit("7", max_new_tokens=4, ignore_eos=True)
    for _ in range(20):
        h.step()
    assert h.finished(other).reason is FinishReason.MAX_TOKENS and len(h.tokens(other)) == 4
    stats = h.books.snapshot()
    assert (stats.sessions_active, stats.sessions_paused) == (1, 1)
    assert len(h.tokens(unread)) == generated and h.finished(unread) is None
    h.read(unread)
    h.run()
    assert h.finished(unread).reason is FinishReason.MAX_TOKENS
    assert len(h.tokens(unread)) == max_new_tokens
    assert h.core.pages.num_used == 0


@pytest.mark.parametrize(
    "mode, most_per_pass", [("sequential", 1), ("interleaved", 1), ("batched", 3), ("continuous", 3)]
)
def test_what_each_mode_puts_in_a_pass(harness, mode, most_per_pass):
    h = harness(mode=mode, max_batch_size=4)
    for i in range(3):
        h.submit(f"{100 + i}", max_new_tokens=4)
    h.run()
    sizes = [len(rows) for rows in h.runner.passes]
    assert max(sizes) == most_per_pass, sizes
    if mode == "sequential":  # one session holds the model until it finishes
        owners = [rows[0].token_ids[0] if rows[0].is_prompt else None for rows in h.runner.passes]
        assert [o for o in owners if o is not None] == [100, 101, 102]
    if mode == "interleaved":  # round robin: no session runs twice in a row while others wait
        firsts = [rows[0].history[0] for rows in h.runner.passes]
        assert all(a != b for a, b in zip(firsts[:6], firsts[1:7])), firsts


def test_eos_a_stop_token_and_a_stop_string_end_a_session(harness):
    h = harness()
    to_eos = h.submit("0", max_new_tokens=10)[0]  # 0 -> 1 -> 3 (EOS skipped by the script)
    h.runner.next_token = lambda row: EOS if row.token_ids[-1] == 1 else row.token_ids[-1] + 1
    stop_token = h.submit("50", max_new_tokens=10, stop_token_ids=(53,))[0]
    stop_string = h.submit("70", max_new_tokens=10, stop=(" 73",))[0]
    h.run()
    assert h.finished(to_eos).reason is FinishReason.EOS and h.tokens(to_eos) == [1, EOS]
    assert h.finished(stop_token).reason is FinishReason.STOP_TOKEN and h.tokens(stop_token) == [51, 52, 53]
    assert h.finished(stop_string).reason is FinishReason.STOP_SEQUENCE
    assert h.text(stop_string) == " 71 72"  # the stop string itself is never sent


def test_ignore_eos_and_min_new_tokens_ban_the_end(harness):
    h = harness()
    h.runner.next_token = lambda row: EOS if EOS not in row.banned else 7
    banned = h.submit("5", max_new_tokens=4, min_new_tokens=2)[0]
    h.run()
    assert h.tokens(banned) == [7, 7, EOS] and h.finished(banned).reason is FinishReason.EOS


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_at_any_step_ends_the_session_and_frees_its_pages(harness, mode):
    h = harness(mode=mode, max_batch_size=4)
    keep, drop = h.submit("1", max_new_tokens=20)[0], h.submit("3", max_new_tokens=20)[0]
    for _ in range(4):
        h.step()
    h.abort(drop, FinishReason.CANCELLED)
    h.run()
    assert h.finished(drop).reason is FinishReason.CANCELLED and len(h.tokens(drop)) < 20
    assert h.finished(keep).reason is FinishReason.MAX_TOKENS and len(h.tokens(keep)) == 20
    h.abort(drop, FinishReason.CANCELLED)  # again, once finished: nothing
    assert h.books.snapshot().finished[FinishReason.CANCELLED] == 1 and h.core.pages.num_used == 0


def test_a_deadline_ends_a_session_with_the_text_so_far(harness):
    h = harness()
    handle = h.submit("1", max_new_tokens=100, deadline=h.now + 0.0035)[0]
    h.run()
    assert h.finished(handle).reason is FinishReason.DEADLINE and 0 < len(h.tokens(handle)) < 100


def test_n_samples_share_the_prompt_and_each_ends_on_its_own(harness):
    h = harness(mode="continuous")
    samples = h.submit(" ".join(str(t) for t in range(100, 120)), n=3, max_new_tokens=3)  # 20 tokens
    h.run()
    assert [h.tokens(s) for s in samples] == [[120, 121, 122]] * 3
    assert [h.finished(s).reason for s in samples] == [FinishReason.MAX_TOKENS] * 3
    prompt_rows = [r for rows in h.runner.passes for r in rows if r.is_prompt]
    # sample 0 computes the prompt; the others find its full page (16 tokens) in the prefix cache
    assert sum(len(r.token_ids) for r in prompt_rows) == 20 + 2 * 4


def test_a_resumed_session_replays_its_delivered_tokens_without_sending_them(harness):
    h = harness()
    handle = h.submit("20", max_new_tokens=5, resume=(21, 22))[0]
    h.run()
    assert h.tokens(handle) == [23, 24, 25] and h.finished(handle).generated_tokens == 5


def test_resumed_tokens_that_already_ended_it_finish_it_at_once(harness):
    h = harness()
    handle = h.submit("20", max_new_tokens=5, resume=(21, EOS))[0]
    assert h.finished(handle).reason is FinishReason.EOS and h.tokens(handle) == []
    assert not h.runner.passes


def test_out_of_pages_a_session_is_preempted_and_recomputed_not_failed(harness):
    # 6 pages of 16 tokens; two sessions of 40 tokens each need 3 pages apiece, plus room to grow
    h = harness(runner=ScriptedRunner(num_pages=6, page_size=16), mode="continuous", prefix_caching="off")
    a = h.submit(" ".join(str(100 + i) for i in range(30)), max_new_tokens=30)[0]
    b = h.submit(" ".join(str(300 + i) for i in range(30)), max_new_tokens=30)[0]
    h.run()
    assert h.finished(a).reason is h.finished(b).reason is FinishReason.MAX_TOKENS
    assert h.tokens(a) == list(range(130, 160)) and h.tokens(b) == list(range(330, 360))
    assert h.books.snapshot().preemptions >= 1 and h.core.pages.num_used == 0


def test_a_failed_pass_ends_only_its_own_sessions(harness):
    h = harness(mode="sequential")

    def fail_on_token_7(row):
        if 7 in row.token_ids:
            raise RuntimeError("boom")
        return row.token_ids[-1] + 1

    h.runner.next_token = fail_on_token_7
    failing, fine = h.submit("5", max_new_tokens=5)[0], h.submit("40", max_new_tokens=3)[0]
    h.run()
    assert h.finished(failing).reason is FinishReason.ERROR and "boom" in h.finished(failing).error
    assert h.finished(fine).reason is FinishReason.MAX_TOKENS


def test_queue_positions_are_reported_to_waiting_sessions_that_asked(harness):
    from braid.server.engine.types import Queued

    h = harness(mode="sequential")
    h.submit("1", max_new_tokens=3)
    waiting = h.submit("5", max_new_tokens=3, report_queue=True)[0]
    h.run()
    positions = [e.position for e in h.events[waiting.session_id] if isinstance(e, Queued)]
    assert positions[:1] == [1] and h.finished(waiting).reason is FinishReason.MAX_TOKENS


def test_rows_carry_each_sessions_adapter_and_an_adapter_is_held_until_its_sessions_end(harness):
    """Sessions with two adapters and none share passes, each row naming its own adapter's load;
    an unload waits for the sessions holding it (its future done once the last ends), and a new
    request for it is NOT_FOUND at once."""
    from braid.server.engine.types import NotFound

    h = harness(max_batch_size=8)
    a = h.adapters.load("a", "/a")
    h.adapters.load("b", "/b")
    assert [i.name for i in h.adapters.list()] == ["a", "b"] and a.rank == 8
    ha = h.submit("10 11", max_new_tokens=3, adapter="a", n=2)
    hb = h.submit("20 21", max_new_tokens=3, adapter="b")
    base = h.submit("30 31", max_new_tokens=3)[0]
    assert h.adapters.users() == {"a": 2, "b": 1}
    h.step()
    by_prompt = {row.token_ids[0]: row.adapter for row in h.runner.passes[0]}
    assert by_prompt[10] == 1 and by_prompt[20] == 2 and by_prompt[30] == 0
    assert len(h.runner.passes[0]) == 3  # a's second sample waits for the prompt, then shares the pass

    freed = h.adapters.unload("a")  # begun: the list leaves it out, new sessions cannot take it
    assert [i.name for i in h.adapters.list()] == ["b"]
    with pytest.raises(NotFound, match="'a' is not loaded"):
        h.submit("10 11", adapter="a")
    assert not freed.done() and 1 in h.runner.adapters  # its two sessions still run with it
    h.run()
    assert freed.done() and h.runner.adapters == {2}  # the last session to finish freed it
    assert [t for handle in ha for t in h.tokens(handle)] == [12, 13, 14] * 2 and h.tokens(hb[0]) == [22, 23, 24]
    assert h.tokens(base) == [32, 33, 34] and h.adapters.users() == {"b": 0}
    with pytest.raises(NotFound, match="'nope'"):
        h.submit("1 2", adapter="nope")
    assert h.books.snapshot().sessions_queued == 0


def test_sessions_that_end_admitted_but_before_their_first_pass_leave_the_queue(harness):
    """Issue 10's leak, where it was hit: interleaved mode admits sessions at once and runs them in
    turn, so sessions whose deadline passes, or that are cancelled, while they hold a slot and before
    their first pass, stayed counted as queued for ever, until every call got RESOURCE_EXHAUSTED.
    (The books alone: test_books.py.)"""
    h = harness(mode="interleaved", max_queued=8)
    hold = [h.submit(str(10 * i), max_new_tokens=300)[0] for i in range(1, 7)]
    h.step()
    ended_early = []
    for _ in range(4):
        short = [h.submit("500", max_new_tokens=50, deadline=h.now + 0.001 * (1 + i))[0] for i in range(4)]
        cancelled = [h.submit("600", max_new_tokens=50)[0] for _ in range(4)]
        h.step()
        assert h.books.snapshot().sessions_queued == 0  # all admitted at once (interleaved), none waits
        for handle in cancelled:
            h.abort(handle, FinishReason.CANCELLED)
        while any(h.finished(s) is None for s in short):
            h.step()
        ended_early += [s for s in short + cancelled if not h.tokens(s)]
        assert all(h.finished(s).reason is FinishReason.DEADLINE for s in short)
    assert len(ended_early) >= 16  # each round's cancels at least: admitted, never run
    for handle in hold:
        h.abort(handle, FinishReason.CANCELLED)
    h.run()
    stats = h.books.snapshot()
    assert (stats.sessions_queued, stats.sessions_active) == (0, 0)
    assert stats.sessions_submitted == sum(stats.finished.values()) == 6 + 4 * 8
    after = h.submit("7", max_new_tokens=2)[0]  # and a new call still gets in, and runs
    h.run()
    assert h.finished(after).reason is FinishReason.MAX_TOKENS


def test_a_batched_session_arrives_on_the_harness_clock_however_long_the_machine_took():
    """The harness steps a clock of its own: a session submitted a while (real time) after the
    harness was made must still start at the next step when the batch wait is 0, as it would on the
    engine's loop, where arrival and steps read one clock. (It arrived on the real clock, ahead of the
    harness's, and a loaded machine left it waiting for steps that never came: a race seen in
    test_embed_pooling's batched case.)"""
    import time

    with Harness(mode="batched", max_batch_size=4) as h:
        time.sleep(0.05)  # the machine's load between the harness's start and the request
        [handle] = h.submit("1 2 3", max_new_tokens=2, ignore_eos=True)
        assert h.step()  # the batch starts at once (max_wait_ms 0)


def test_a_resumed_stream_gets_only_the_text_it_lacks_when_a_stop_string_ends_it():
    """A stop string in the last token: the text before it in that token comes in the final
    message, with the token. A client that has the token has that text, so a resume from it sends
    none again (it sent " 2" a second time); a client that lacks it gets it, once."""
    whole = Harness()
    handle = whole.submit("20", max_new_tokens=10, stop=("3",))[0]
    whole.run()
    assert whole.text(handle) == " 21 22 2" and whole.tokens(handle) == [21, 22, 23]
    for delivered, rest in (((21, 22, 23), ""), ((21, 22), " 2"), ((21,), " 22 2")):
        h = Harness()
        handle = h.submit("20", max_new_tokens=10, stop=("3",), resume=delivered)[0]
        h.run()
        assert h.finished(handle).reason is FinishReason.STOP_SEQUENCE
        assert h.text(handle) == rest, delivered
        h.close()
    whole.close()
