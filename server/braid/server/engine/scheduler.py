"""The scheduler: which sessions run in the next forward pass, and with how many tokens.

The four modes share everything else; they differ only in `_admit` (who gets a cache slot) and
`_pick` (whose tokens go into the pass):

- sequential: one session holds the model until it finishes.
- interleaved: every admitted session has its own slot; one session per pass, round robin.
- batched: waiting sessions are gathered (up to max_batch_size, or max_wait) and run together,
  prompts in one packed prefill, then decode steps, until the whole batch has left.
- continuous: sessions join the running batch at every step and leave the moment they finish.
"""

from __future__ import annotations

from collections import deque

from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.types import Mode
from braid.server.runner.kv_cache import KVCache
from braid.server.runner.model_runner import Work


class Scheduler:
    def __init__(self, mode: Mode, cache: KVCache, max_wait_s: float, prefill_chunk: int) -> None:
        self.mode = mode
        self.cache = cache
        self.max_wait_s = max_wait_s
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Session] = deque()
        self.running: list[Session] = []
        self._turn = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, session: Session) -> None:
        self.waiting.append(session)

    def remove(self, session: Session) -> None:
        """Takes a finished or cancelled session out, and frees its cache slot at once."""
        if session.status is SessionStatus.WAITING:
            self.waiting.remove(session)
        elif session.status is SessionStatus.RUNNING:
            self.running.remove(session)
            self.cache.free(session.slot)
            session.slot = None
        session.status = SessionStatus.FINISHED

    def schedule(self, now: float) -> list[Work]:
        self._admit(now)
        return self._pick()

    def wait_hint(self, now: float) -> float | None:
        """Seconds the model thread may sleep before a batch should start (batched mode)."""
        if self.mode is Mode.BATCHED and self.waiting and not self.running:
            return max(0.0, self.waiting[0].arrived + self.max_wait_s - now)
        return None

    def _admit(self, now: float) -> None:
        if self.mode is Mode.SEQUENTIAL:
            limit = 0 if self.running else 1
        elif self.mode is Mode.BATCHED:
            batch_full = len(self.waiting) >= self.cache.num_slots
            waited = bool(self.waiting) and now - self.waiting[0].arrived >= self.max_wait_s
            limit = self.cache.num_slots if not self.running and (batch_full or waited) else 0
        else:
            limit = self.cache.num_slots
        while self.waiting and limit > 0 and self.cache.num_free > 0:
            session = self.waiting.popleft()
            session.slot = self.cache.allocate()
            session.status = SessionStatus.RUNNING
            self.running.append(session)
            limit -= 1

    def _pick(self) -> list[Work]:
        if not self.running:
            return []
        if self.mode is Mode.SEQUENTIAL:
            return [self._work(self.running[0], self.prefill_chunk)]
        if self.mode is Mode.INTERLEAVED:
            self._turn = (self._turn + 1) % len(self.running)
            return [self._work(self.running[self._turn], self.prefill_chunk)]
        # batched: the whole batch's prompts go in one packed prefill; continuous: a token budget
        # per pass keeps running streams moving while a long prompt is prefilled in chunks.
        budget = None if self.mode is Mode.BATCHED else self.prefill_chunk
        work = []
        for session in self.running:
            if not session.is_prefilling:
                work.append(Work(session, 1))
            elif budget is None or budget > 0:
                item = self._work(session, budget)
                budget = None if budget is None else budget - item.num_tokens
                work.append(item)
        return work

    @staticmethod
    def _work(session: Session, budget: int | None) -> Work:
        n = session.num_uncached
        return Work(session, n if budget is None else min(n, budget))
