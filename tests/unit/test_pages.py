"""The KV cache's books (engine/pages.py): sharing, salts, eviction, and a property test that random
admit, grow, share, cancel and finish sequences keep every reference count exact."""

from __future__ import annotations


from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from braid.server.engine.pages import Pages


P = 16


@dataclass
class Seq:
    token_ids: list[int]
    cache_salt: str = ""
    adapter_key: str = ""
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)
    reads_prefix_cache: bool = True


def _compute(pages: Pages, s: Seq, n: int | None = None) -> None:
    """The model computed n more tokens (default: all) of s."""
    before = s.num_cached
    s.num_cached = len(s.token_ids) if n is None else s.num_cached + n
    pages.commit(s, before)


SYSTEM = list(range(100, 140))  # 40 tokens: two full pages and 8 more


def test_a_holder_that_must_compute_its_prompt_reads_nothing_from_the_cache():
    """prompt_logprobs scores every prompt position, so its session computes them all."""
    pages = Pages(32, P)
    first = Seq(SYSTEM + [1, 2, 3])
    assert pages.admit(first)
    _compute(pages, first)
    pages.release(first)
    scorer = Seq(SYSTEM + [1, 2, 3], reads_prefix_cache=False)
    assert pages.admit(scorer) and scorer.num_cached == 0
    pages.release(scorer)
    reader = Seq(SYSTEM + [1, 2, 3])
    assert pages.admit(reader) and reader.num_cached == 2 * P


def test_sessions_with_a_common_prefix_share_its_full_pages():
    pages = Pages(32, P)
    first = Seq(SYSTEM + [1, 2, 3])
    assert pages.admit(first) and first.num_cached == 0
    _compute(pages, first)
    second = Seq(SYSTEM + [7, 8])
    assert pages.admit(second)
    assert second.num_cached == 32 and second.pages[:2] == first.pages[:2] and second.pages[2] != first.pages[2]
    assert [pages.refs(p) for p in first.pages] == [2, 2, 1]
    pages.release(first)  # a cancel: only its own references go
    assert [pages.refs(p) for p in second.pages] == [1, 1, 1]
    pages.check([second])


def test_a_finished_sessions_prefix_stays_cached_and_is_evicted_last_used_first():
    pages = Pages(6, P)
    a = Seq(list(range(1, 34)))  # 33 tokens: 3 pages, two named once computed
    assert pages.admit(a)
    _compute(pages, a)
    pages.release(a)
    assert pages.num_used == 0 and pages.num_cached == 2
    b = Seq(list(range(1, 34)))
    assert pages.admit(b) and b.num_cached == 32  # a whole hit but the last page
    pages.release(b)
    c = Seq(list(range(500, 580)))  # 80 tokens: 5 pages, so one cached page must go
    assert pages.admit(c)
    assert pages.num_evictions == 1 and pages.num_cached == 1
    pages.release(c)
    d = Seq(list(range(1, 34)))
    assert pages.admit(d) and d.num_cached == 16  # the second page, the last used, went first
    pages.check([d])


def test_the_last_token_is_always_computed():
    pages = Pages(8, P)
    a = Seq(list(range(1, 33)))  # exactly two pages
    assert pages.admit(a)
    _compute(pages, a)
    b = Seq(list(range(1, 33)))
    assert pages.admit(b) and b.num_cached == 16  # the page holding its last token is its own


def test_a_salt_keeps_prefixes_apart():
    pages = Pages(16, P)
    a = Seq(SYSTEM + [1], cache_salt="tenant-a")
    assert pages.admit(a)
    _compute(pages, a)
    b = Seq(SYSTEM + [1], cache_salt="tenant-b")
    c = Seq(SYSTEM + [1], cache_salt="tenant-a")
    assert pages.admit(b) and b.num_cached == 0
    assert pages.admit(c) and c.num_cached == 32


def test_an_adapter_keeps_prefixes_apart_and_so_does_its_reload():
    """Pages computed under one LoRA adapter are found only by the same adapter's same load (its
    key, engine/adapters.py), never by the base model, another adapter, or the adapter reloaded."""
    pages = Pages(16, P)
    a = Seq(SYSTEM + [1], adapter_key="lora:1")
    assert pages.admit(a)
    _compute(pages, a)
    for other in ("", "lora:2", "lora:3"):
        b = Seq(SYSTEM + [1], adapter_key=other)
        assert pages.admit(b) and b.num_cached == 0, other
    c = Seq(SYSTEM + [1], adapter_key="lora:1")
    assert pages.admit(c) and c.num_cached == 32
    salted = Seq(SYSTEM + [1], cache_salt="lora:1")  # a salt that spells the key is not the key
    assert pages.admit(salted) and salted.num_cached == 0


def test_with_prefix_caching_off_nothing_is_shared_or_kept():
    pages = Pages(16, P, prefix_caching=False)
    a = Seq(SYSTEM + [1])
    assert pages.admit(a)
    _compute(pages, a)
    b = Seq(SYSTEM + [1])
    assert pages.admit(b) and b.num_cached == 0
    pages.release(a)
    pages.release(b)
    assert pages.num_cached == 0 and pages.num_available == 16


def test_admission_leaves_the_reserve_and_changes_nothing_when_it_does_not_fit():
    pages = Pages(4, P)
    a = Seq(list(range(40)))  # 3 pages
    assert not pages.admit(a, reserve=2)
    assert a.pages == [] and pages.num_available == 4
    assert pages.admit(a, reserve=1)
    a.num_cached = 40
    assert not pages.grow(a, 40) and len(a.pages) == 3  # 80 tokens need 5 pages
    assert pages.grow(a, 9) and len(a.pages) == 4 and pages.num_available == 0


# ---- the property test ---------------------------------------------------------------------

_PREFIXES = [list(range(1000, 1000 + n)) for n in (0, 16, 20, 48)]  # shared system prompts
_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "compute", "grow", "finish", "preempt"]),
        st.integers(0, 1000),
        st.integers(0, 3),
        st.integers(1, 40),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, num_pages=st.integers(3, 24))
def test_random_admits_grows_shares_cancels_and_finishes_keep_the_books(ops, num_pages):
    pages = Pages(num_pages, P)
    running: list[Seq] = []
    for op, pick, prefix, n in ops:
        if op == "admit":
            s = Seq(_PREFIXES[prefix] + [pick] * n, cache_salt=str(pick % 2))
            if pages.admit(s, reserve=len(running)):
                assert s.num_cached % P == 0 and s.num_cached < len(s.token_ids)
                running.append(s)
            else:
                assert s.pages == []
        elif running:
            s = running[pick % len(running)]
            if op == "compute":
                _compute(pages, s, min(n, len(s.token_ids) - s.num_cached))
            elif op == "grow" and s.num_cached == len(s.token_ids):  # a decode step: one more token
                if pages.grow(s, 1):
                    s.token_ids.append(pick)
            elif op in ("finish", "preempt"):  # a preempted session is released like a finished one
                pages.release(s)
                running.remove(s)
        pages.check(running)
        assert pages.num_used == len({p for s in running for p in s.pages})
    for s in running:
        pages.release(s)
    pages.check([])
    assert pages.num_used == 0 and pages.num_available == num_pages
