"""The KV cache's books: which pages each session holds, which full pages hold which prefix, and
which pages can be taken back. Torch-free: the runner holds the memory (runner/kv_cache.py), this
module only decides which pages a row's page table names.

After nano-vllm's block_manager.py and vLLM's prefix caching:

- A session holds a page table: its pages in position order, enough for every token it has.
- A *full* page (every position computed) is named by a key: a hash of its tokens and of the key of
  the page before it, from a root made of the session's cache salt. So a key names a whole prefix,
  and only sessions with the same salt can meet the same key. A session whose prompt starts with
  named pages shares them, reference-counted and never copied. A shared page is never written
  again: a session writes only the positions after its shared prefix.
- A page no session holds is free. A free page with a key stays cached, in least-recently-used
  order, and is taken back (evicted) only when no free page without a key is left.

The hash is blake2b, 128 bits, as vLLM moved to a cryptographic hash: with Python's 64-bit hash a
crafted prompt could collide with another tenant's prefix and read its keys and values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol


class Holder(Protocol):
    """What the pages need of a session (engine/session.py)."""

    token_ids: list[int]  # every token so far, prompt first
    num_cached: int  # tokens whose keys and values are computed, or shared
    cache_salt: str
    adapter_key: str  # its LoRA adapter's load ("": the base model): part of the keys, as the salt is
    pages: list[int]  # the page table
    page_keys: list[bytes]  # keys of its first full pages, computed as needed

    @property
    def reads_prefix_cache(self) -> bool:
        """False: every position computed, even those cached."""


class PageObserver(Protocol):
    """Told on the model thread when a page is named (it can be shared from now on) and when its
    name is dropped (evicted for other use); engine/kv_events.py implements it. Must not block."""

    def on_stored(self, key: bytes, parent: bytes, num_tokens: int, cache_salt: str, adapter_key: str) -> None: ...

    def on_evicted(self, key: bytes) -> None: ...


class NoPageObserver:
    """Nobody listening: the default."""

    def on_stored(self, key: bytes, parent: bytes, num_tokens: int, cache_salt: str, adapter_key: str) -> None:
        pass

    def on_evicted(self, key: bytes) -> None:
        pass


class Pages:
    def __init__(
        self, num_pages: int, page_size: int, prefix_caching: bool = True, observer: PageObserver | None = None
    ) -> None:
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.observer: PageObserver = observer or NoPageObserver()
        # Per page: the sessions holding it, and its key once it is full and named. Arrays, not an
        # object per page: a small model's cache can have a million pages, and making that many
        # objects took seconds of every start.
        self._refs = array("l", [0]) * num_pages
        self._key_of: dict[int, bytes] = {}
        # Free pages without a key, as a stack: the page freed last is reused first, so the memory
        # in use stays the memory already touched (the OS commits the cache as it is written).
        self._free = array("l", range(num_pages - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free pages with a key, least recent first
        self._by_key: dict[bytes, int] = {}
        self.num_evictions = 0  # cached pages taken back for other use

    @property
    def num_pages(self) -> int:
        return len(self._refs)

    @property
    def num_available(self) -> int:
        """Pages a session could be given now: the free ones and the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages some session holds."""
        return self.num_pages - self.num_available

    @property
    def num_cached(self) -> int:
        """Pages no session holds that keep a prefix for the next session that starts with it."""
        return len(self._cached)

    def refs(self, page: int) -> int:
        """The sessions holding this page."""
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- a session's life -------------------------------------------------------------------

    def admit(self, s: Holder, reserve: int = 0) -> bool:
        """Gives a waiting session its page table: the cached pages that hold the longest prefix
        of its tokens, and new pages for the rest, if that leaves `reserve` pages available. Sets
        s.num_cached to the tokens found in the cache. False, and nothing changes, if it does not fit.

        The last token is always computed (its logits are needed), so a prompt that is cached
        whole still computes its last page."""
        hits = self._match(s)
        taken = sum(self._refs[p] == 0 for p in hits)  # cached pages the hits take out of the available
        new = self.pages_for(len(s.token_ids)) - len(hits)
        if new + taken + reserve > self.num_available:
            return False
        for p in hits:
            if self._refs[p] == 0:
                del self._cached[p]
            self._refs[p] += 1
        s.pages = hits + [self._take() for _ in range(new)]
        s.num_cached = len(hits) * self.page_size
        return True

    def grow(self, s: Holder, num_tokens: int) -> bool:
        """Pages for positions up to s.num_cached + num_tokens; False, and nothing changes, if they
        are not available."""
        new = self.pages_for(s.num_cached + num_tokens) - len(s.pages)
        if new > self.num_available:
            return False
        s.pages += [self._take() for _ in range(new)]
        return True

    def shrink(self, s: Holder, num_tokens: int) -> None:
        """Frees the pages past the first that hold `num_tokens` tokens: pages grown for speculative
        proposals that were rejected. They were never full of computed tokens, so never named."""
        keep = self.pages_for(num_tokens)
        for p in s.pages[keep:]:
            assert self._refs[p] == 1 and p not in self._key_of, f"page {p} is shared or named"
            self._refs[p] = 0
            self._free.append(p)
        del s.pages[keep:]

    def commit(self, s: Holder, before: int) -> None:
        """Names the pages that became full since the session had `before` tokens computed, so the
        sessions after it can share them. A page whose key another page already holds (two
        sessions computed the same prefix at once) stays unnamed and is freed with its session."""
        if not self.prefix_caching:
            return
        first, full = before // self.page_size, s.num_cached // self.page_size
        if full <= first:
            return
        keys = self._keys(s, full)
        for i in range(first, full):
            p = s.pages[i]
            if p not in self._key_of and keys[i] not in self._by_key:
                self._key_of[p] = keys[i]
                self._by_key[keys[i]] = p
                parent = keys[i - 1] if i else _root(s.cache_salt, s.adapter_key)
                self.observer.on_stored(keys[i], parent, self.page_size, s.cache_salt, s.adapter_key)

    def release(self, s: Holder) -> None:
        """Drops the session's references. Its named pages stay cached, the last ones nearest to
        eviction (they are the least likely to be shared); the rest are free."""
        for p in reversed(s.pages):
            self._refs[p] -= 1
            assert self._refs[p] >= 0, f"page {p} released more often than taken"
            if self._refs[p] == 0 and p in self._key_of:
                self._cached[p] = None
            elif self._refs[p] == 0:
                self._free.append(p)
        s.pages = []

    def check(self, holders: list[Holder]) -> None:
        """Asserts the books balance: every page's reference count is the number of page tables
        that hold it, and every page is exactly one of held, cached and free. O(pages): for tests
        and the soak, not for every step."""
        refs = [0] * self.num_pages
        for s in holders:
            for p in s.pages:
                refs[p] += 1
        assert refs == self._refs.tolist(), "reference counts differ from the page tables"
        held = {p for p, count in enumerate(self._refs) if count}
        assert not held & set(self._cached) and not held & set(self._free), "a held page is also free"
        assert len(held) + len(self._cached) + len(self._free) == self.num_pages, "a page is lost or counted twice"
        assert all(p in self._key_of for p in self._cached)
        assert all(p not in self._key_of for p in self._free)
        assert all(self._key_of.get(p) == k for k, p in self._by_key.items())
        assert len(self._key_of) == len(self._by_key)

    # ---- inside -----------------------------------------------------------------------------

    def _match(self, s: Holder) -> list[int]:
        """The named pages holding the longest prefix of the session's tokens but its last."""
        if not self.prefix_caching or not s.reads_prefix_cache:
            return []
        full = (len(s.token_ids) - 1) // self.page_size
        hits: list[int] = []
        for key in self._keys(s, full):
            page = self._by_key.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def _keys(self, s: Holder, count: int) -> list[bytes]:
        """The keys of the session's first `count` full pages (computed once per session)."""
        keys, size = s.page_keys, self.page_size
        if not keys and count:
            keys.append(_key(_root(s.cache_salt, s.adapter_key), s.token_ids[:size]))
        while len(keys) < count:
            i = len(keys)
            keys.append(_key(keys[-1], s.token_ids[i * size : (i + 1) * size]))
        return keys[:count]

    def _take(self) -> int:
        """A page for a session to write: a free one, else the least recently used cached one."""
        if self._free:
            p = self._free.pop()
        else:
            p, _ = self._cached.popitem(last=False)
            key = self._key_of.pop(p)
            del self._by_key[key]
            self.num_evictions += 1
            self.observer.on_evicted(key)
        self._refs[p] = 1
        return p


def _root(salt: str, adapter_key: str = "") -> bytes:
    """A prefix's root: the cache salt, and the LoRA adapter (its load, not its name) where there
    is one, so pages computed under one adapter are never found by another or by the base model."""
    named = b"braid-kv:" + salt.encode()
    if adapter_key:
        named += b"\0adapter:" + adapter_key.encode()
    return hashlib.blake2b(named, digest_size=16).digest()


def _key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
