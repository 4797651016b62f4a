"""Speculative decoding's engine side (engine/speculation.py, the core's verified rows), stepped in
process with a scripted runner that verifies proposals as the real one does: the same tokens as
plain decoding in every mode, fewer passes where the output repeats, and stops, limits, back-off,
pages and books as without it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from braid.server.config import EngineConfig, SettingError
from braid.server.engine.scheduler import SPECULATION_PASS_TOKENS
from braid.server.engine.speculation import DraftProposer, NgramProposer, Speculator
from braid.server.engine.types import FinishReason
from engine_fakes import Harness, ScriptedRunner


MODES = ("sequential", "interleaved", "batched", "continuous")
CYCLE = [10, 11, 12, 13, 14, 15, 16]


def _cycling(row) -> int:
    """The model of these tests: it continues the cycle 10, 11, ... 16, 10, ... from its last token."""
    last = row.token_ids[-1]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else CYCLE[0]


@pytest.fixture
def harness():
    made = []

    def make(next_token=_cycling, **kw) -> Harness:
        made.append(Harness(ScriptedRunner(next_token=next_token), **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _generate(h: Harness, prompts: list[str], **params) -> list[list[int]]:
    handles = [h.submit(p, **params)[0] for p in prompts]
    h.run()
    assert h.core.pages.num_used == 0
    h.core.pages.check([])
    return [h.tokens(handle) for handle in handles]


# ---- the n-gram proposer ----------------------------------------------------------------------


def test_the_proposer_copies_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == ([7, 8], 7)  # the latest, not the first
    assert proposer.propose([5, 6, 1, 2, 4, 2, 7, 1, 2], 3) == ([4, 2, 7], 4)  # the longest suffix: (1, 2), not (2,)
    assert proposer.propose([1, 2, 3, 4], 3) == ([], -1)  # nothing repeats
    assert proposer.propose([1, 2, 1], 8) == ([2, 1], 1)  # what followed, up to the end
    assert NgramProposer(2, 3).propose([5, 1, 7, 1], 2) == ([], -1)  # one token matching is below --ngram-min 2


def test_the_proposer_matches_whole_tokens_only():
    # 256 and 1 share bytes across a token boundary in the packed array: no false match
    assert NgramProposer(1, 1).propose([1, 256, 0, 0, 7, 1], 2) == ([256, 0], 1)
    assert NgramProposer(2, 2).propose([0, 1, 0, 0, 1, 5, 0, 1], 2) == ([5, 0], 5)
    assert NgramProposer(2, 2).propose([0, 1, 0, 0, 1, 5, 0, 1], 2, copy_at=0) == ([0, 0], 2)


def test_a_copy_goes_on_from_its_copy_point():
    proposer = NgramProposer(2, 3)
    # the passage holds "a b" twice (indices 0 and 6), and the output, copying from the start, has
    # just written "a b" again: the match nearest after its copy point, not the latest
    passage = [1, 2, 30, 3, 4, 5, 1, 2, 40, 6, 7]
    tokens = [*passage, 9, 1, 2]
    assert proposer.propose(tokens, 3) == ([40, 6, 7], 8)  # no copy point: the latest match
    assert proposer.propose(tokens, 3, copy_at=0) == ([30, 3, 4], 2)
    # a changed word ("rose" for "rises"): no run of two tokens matches, the last token alone
    # does just after the copy point, and the copy goes on
    passage = [20, 21, 22, 23, 24, 25]
    tokens = passage + [20, 21, 99, 23]
    assert proposer.propose(tokens, 2) == ([], -1)
    assert proposer.propose(tokens, 2, copy_at=8) == ([], -1)  # past NEAR_COPY of any match
    assert proposer.propose(tokens, 2, copy_at=2) == ([24, 25], 4)


# ---- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_speculation_gives_the_same_tokens_in_fewer_passes(harness, mode):
    prompts = ["10 11 12 13 14 15 16 10", "12 13 14 15 16 10 11 12 13", "14 15"]
    plain = harness(mode=mode, max_batch_size=4)
    expected = _generate(plain, prompts, max_new_tokens=20)
    fast = harness(mode=mode, max_batch_size=4, speculative="ngram", speculative_tokens=4)
    assert _generate(fast, prompts, max_new_tokens=20) == expected
    assert len(fast.runner.passes) < len(plain.runner.passes) * 0.6, (len(fast.runner.passes), len(plain.runner.passes))
    stats = fast.books.snapshot()
    assert stats.speculative_accepted_tokens > 0
    assert stats.speculative_accepted_tokens == stats.speculative_proposed_tokens  # the cycle never misses
    assert stats.tokens_generated == plain.books.snapshot().tokens_generated == 60
    finished = [e for events in fast.events.values() for e in events if hasattr(e, "accepted_tokens")]
    assert sum(f.accepted_tokens for f in finished) == stats.speculative_accepted_tokens


def _wandering(row) -> int:
    """A model that picks among the prompt's four tokens by a hash of the position: the n-gram's
    proposals are mostly wrong."""
    return 20 + random.Random(len(row.history)).randrange(4)


def test_rejected_proposals_change_no_token_and_free_their_pages(harness):
    prompt = " ".join(["20 21 22 23"] * 8)  # 32 tokens: two full pages, then the proposals' pages
    expected = _generate(harness(next_token=_wandering), [prompt], max_new_tokens=60)
    h = harness(next_token=_wandering, speculative="ngram", speculative_tokens=16, ngram_min=1)
    handle = h.submit(prompt, max_new_tokens=60)[0]
    while h.core.sessions:
        h.step()
        for s in h.core.scheduler.running:  # pages for its computed tokens, as plain decoding holds
            assert len(s.pages) == h.core.pages.pages_for(s.num_cached), (len(s.pages), s.num_cached)
        h.core.pages.check(h.core.scheduler.running)
    assert h.tokens(handle) == expected[0]
    finished = h.finished(handle)
    assert finished.proposed_tokens > 2 * finished.accepted_tokens, finished


def test_a_session_whose_proposals_miss_rests_longer_each_time_an_ngram_one_after_its_first_miss():
    draft = Speculator(DraftProposer.__new__(DraftProposer), 8, 512)  # verified() needs no runner
    ngram = Speculator(NgramProposer(1, 3), 8, 512)
    for speculator, expected in ((draft, [1, 2, 4, 8, 16, 32, 32, 32]), (ngram, [0, 1, 2, 4, 8, 8, 8, 8])):
        session = SimpleNamespace(num_proposed=0, num_accepted=0, misses=0, rest=0, window=0, copy_at=None)
        rests = []
        for _ in range(8):
            speculator.verified(session, 4, 0)
            rests.append(session.rest)
        assert rests == expected
        speculator.verified(session, 4, 1)
        assert (session.misses, session.num_proposed, session.num_accepted) == (0, 36, 1)


def test_the_window_shrinks_after_a_rejection_and_doubles_after_a_full_acceptance():
    speculator = Speculator(NgramProposer(1, 3), 8, 512)
    session = SimpleNamespace(num_proposed=0, num_accepted=0, misses=0, rest=0, window=0, copy_at=3)
    windows, copy_points = [], []
    for proposed, accepted in ((8, 2), (3, 3), (6, 6), (8, 8), (8, 0), (2, 1)):
        speculator.verified(session, proposed, accepted)
        windows.append(session.window)
        copy_points.append(session.copy_at)
    assert windows == [3, 6, 8, 8, 2, 2]  # never below 2 after a rejection
    assert copy_points == [6, 10, 17, 26, 27, 29]  # on past what was accepted and the token after
    assert Speculator(NgramProposer(1, 3), 1, 512).verified(session, 1, 0) is None and session.window == 1


def test_no_page_holding_a_rejected_token_is_named_for_the_prefix_cache(harness):
    h = harness(next_token=_wandering, speculative="ngram", speculative_tokens=16, ngram_min=1)
    prompt = " ".join(["20 21 22 23"] * 4) + " 20"  # proposes 21 22 23 20 ...: the model wanders
    handle = h.submit(prompt, max_new_tokens=30)[0]
    h.run()
    tokens = [int(t) for t in prompt.split()] + h.tokens(handle)
    size = h.core.pages.page_size
    named = {key for key in h.core.pages._by_key}
    from braid.server.engine.pages import _key, _root

    key = _root("")
    for i in range(len(tokens) // size):  # every named page is a page of the real tokens
        key = _key(key, tokens[i * size : (i + 1) * size])
        named.discard(key)
    assert not named


def test_a_stop_among_accepted_tokens_ends_the_stream_there(harness):
    h = harness(speculative="ngram", speculative_tokens=8)
    handle = h.submit("10 11 12 13 14 15 16 10", max_new_tokens=30, stop_token_ids=(14,))[0]
    h.run()
    assert h.tokens(handle) == [11, 12, 13, 14]
    assert h.finished(handle).reason is FinishReason.STOP_TOKEN
    assert h.finished(handle).accepted_tokens >= 3  # 11 12 13 14 came from one verified row
    assert h.books.snapshot().tokens_generated == 4  # not the confirmed tokens after the stop
    stop_text = harness(speculative="ngram", speculative_tokens=8)
    handle = stop_text.submit("10 11 12 13 14 15 16 10", max_new_tokens=30, stop=(" 13",))[0]
    stop_text.run()
    assert stop_text.text(handle) == " 11 12"
    assert stop_text.finished(handle).reason is FinishReason.STOP_SEQUENCE


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_never_past_max_new_tokens(harness, max_new_tokens):
    h = harness(speculative="ngram", speculative_tokens=8)
    handle = h.submit("10 11 12 13 14 15 16 10", max_new_tokens=max_new_tokens)[0]
    h.run()
    assert h.tokens(handle) == [11, 12, 13, 14, 15, 16, 10, 11, 12][:max_new_tokens]
    assert h.finished(handle).reason is FinishReason.MAX_TOKENS
    assert all(r.num_proposals < max_new_tokens for rows in h.runner.passes for r in rows)


def test_min_new_tokens_and_the_opt_out_propose_nothing(harness):
    h = harness(speculative="ngram")
    first = h.submit("10 11 12 13 14 15 16 10", max_new_tokens=12, disable_speculation=True)[0]
    h.run()
    assert not any(r.num_proposals for rows in h.runner.passes for r in rows)
    assert h.finished(first).proposed_tokens == 0
    h.runner.passes.clear()
    h.submit("10 11 12 13 14 15 16 10", max_new_tokens=12, min_new_tokens=6)
    h.run()
    generated = [len(r.history) - 8 for rows in h.runner.passes for r in rows if r.num_proposals]
    assert generated and min(generated) >= 6  # proposals only once the end is allowed


def test_a_full_pass_drops_the_proposals(harness):
    h = harness(speculative="ngram", max_batch_size=32)
    _generate(h, ["10 11 12 13 14 15 16 10"] * SPECULATION_PASS_TOKENS, max_new_tokens=8)
    for rows in h.runner.passes:
        assert sum(len(r.token_ids) for r in rows if not r.is_prompt) <= max(SPECULATION_PASS_TOKENS, len(rows))
    assert not any(r.num_proposals for rows in h.runner.passes for r in rows if len(rows) >= SPECULATION_PASS_TOKENS)


def test_cancelled_between_passes_holds_no_page(harness):
    h = harness(speculative="ngram")
    handle = h.submit("10 11 12 13 14 15 16 10", max_new_tokens=50)[0]
    for _ in range(4):
        h.step()
    assert h.books.snapshot().speculative_proposed_tokens > 0
    h.abort(handle, FinishReason.CANCELLED)
    h.step()
    assert h.finished(handle).reason is FinishReason.CANCELLED
    assert h.core.pages.num_used == 0 and h.core.books_balance() == (0, 0, 0)


def test_preempted_speculating_sessions_resume_with_the_same_tokens(harness):
    prompts = [f"{10 + i} 11 12 13 14 15 16 10" for i in range(4)]
    expected = _generate(harness(), prompts, max_new_tokens=40)
    small = ScriptedRunner(num_pages=5, next_token=_cycling)
    h = Harness(small, speculative="ngram", speculative_tokens=8)
    try:
        assert _generate(h, prompts, max_new_tokens=40) == expected
        assert h.books.snapshot().preemptions > 0
    finally:
        h.close()


def test_a_session_preempted_for_an_earlier_rows_pages_takes_none_for_its_proposals():
    """Two copying sessions in a cache too small for both: the first's new page preempts the
    second, which was later in the same pass with proposals of its own. It took a page for them
    anyway, kept it while waiting, and lost it when admitted again (its page table written
    over): a page leaked at every such preemption, and the books showed a page held with no
    session running."""
    small = ScriptedRunner(num_pages=8, page_size=16, next_token=lambda row: 50)
    with Harness(small, speculative="ngram", prefix_caching="off") as h:
        handles = [h.submit(" ".join(str(first + i) for i in range(40)), max_new_tokens=30)[0] for first in (100, 300)]
        h.run()  # the books are checked after every step
        assert [h.finished(x).reason for x in handles] == [FinishReason.MAX_TOKENS] * 2
        assert h.books.snapshot().preemptions >= 1 and h.core.pages.num_used == 0


# ---- a draft model -----------------------------------------------------------------------------


def _drafted(h: Harness, draft: ScriptedRunner, prompts: list[str], **params) -> list[list[int]]:
    tokens = _generate(h, prompts, **params)
    assert h.core.speculator.proposer.pages.num_used == 0  # every session's draft pages given back
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_a_right_draft_gives_the_same_tokens_in_fewer_passes(harness, mode):
    prompts = ["10 11", "12", "14 15 16"]  # nothing to copy: only a draft can propose
    plain = harness(mode=mode, max_batch_size=4)
    expected = _generate(plain, prompts, max_new_tokens=24)
    draft = ScriptedRunner(next_token=_cycling)  # the draft agrees with the model
    h = Harness(
        ScriptedRunner(next_token=_cycling),
        draft,
        mode=mode,
        max_batch_size=4,
        speculative="draft",
        draft_model="draft",
        speculative_tokens=4,
    )
    try:
        assert _drafted(h, draft, prompts, max_new_tokens=24) == expected
        assert len(h.runner.passes) < len(plain.runner.passes) * 0.5
        stats = h.books.snapshot()
        assert stats.speculative_accepted_tokens == stats.speculative_proposed_tokens > 0
        # the draft fed each token once: its cache was kept across steps, not recomputed
        fed = sum(len(r.token_ids) for rows in draft.passes for r in rows)
        assert fed <= sum(len(p.split()) for p in prompts) + 3 * 24 + 3 * 4, fed
    finally:
        h.close()


def test_a_wrong_draft_changes_no_token(harness):
    from engine_fakes import _count_up

    prompts = ["10 11", "12 13 14 15 16 10 11 12"]
    expected = _generate(harness(), prompts, max_new_tokens=30)
    draft = ScriptedRunner(next_token=_count_up)  # 12 13 14 15 16 17 ...: wrong after 16
    h = Harness(
        ScriptedRunner(next_token=_cycling), draft, speculative="draft", draft_model="draft", speculative_tokens=8
    )
    try:
        assert _drafted(h, draft, prompts, max_new_tokens=30) == expected
        stats = h.books.snapshot()
        assert 0 < stats.speculative_accepted_tokens < stats.speculative_proposed_tokens
    finally:
        h.close()


def test_a_draft_session_cancelled_gives_its_draft_pages_back(harness):
    draft = ScriptedRunner(next_token=_cycling)
    h = Harness(ScriptedRunner(next_token=_cycling), draft, speculative="draft", draft_model="draft")
    try:
        handle = h.submit("10 11 12", max_new_tokens=100)[0]
        for _ in range(3):
            h.step()
        assert h.core.speculator.proposer.pages.num_used > 0
        h.abort(handle, FinishReason.CANCELLED)
        assert h.core.speculator.proposer.pages.num_used == 0 and h.core.pages.num_used == 0
    finally:
        h.close()


@pytest.mark.parametrize(
    "settings, flag",
    [
        (dict(speculative_tokens=0), "--speculative-tokens"),
        (dict(speculative_tokens=17), "--speculative-tokens"),
        (dict(ngram_min=4, ngram_max=3), "--ngram-min"),
        (dict(speculative="fast"), "--speculative"),
        (dict(draft_model="x.gguf"), "--draft-model"),
        (dict(speculative="draft"), "--speculative draft: needs --draft-model"),
    ],
)
def test_bad_settings_name_their_flag(settings, flag):
    with pytest.raises(SettingError, match=flag):
        EngineConfig(**settings)


def test_a_resumed_stream_goes_on_as_it_would_have(harness):
    prompt = "10 11 12 13 14 15 16 10"
    expected = _generate(harness(), [prompt], max_new_tokens=20)[0]
    h = harness(speculative="ngram")
    handle = h.submit(prompt, resume=expected[:7], max_new_tokens=20)[0]
    h.run()
    assert h.tokens(handle) == expected[7:]
    assert h.finished(handle).accepted_tokens > 0
