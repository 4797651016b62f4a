"""The scheduler: which sessions run in the next forward pass, and with how many tokens.

The four modes share everything else; they differ only in `_admit` (who gets a cache slot) and
`_pick` (whose tokens go into the pass):

- sequential: one session holds the model until it finishes.
- interleaved: every admitted session has its own slot; one session per pass, round robin.
- batched: waiting sessions are gathered (up to max_batch_size, or max_wait), bucketed by prompt
  length, and run together: prompts in one packed prefill, then decode steps, until the whole
  batch has left.
- continuous: sessions join the running batch at every step and leave the moment they finish.

Admission order is the same in every mode: interactive sessions first, except that a batch session
that has waited `batch_max_wait_s` goes next, so batch work waits a bounded time, never forever.
A pass holds at most `max_batch_size` sessions; when more are running (--max-sessions is larger),
batched and continuous passes take turns over them.

A *paused* session (its client has stopped reading) keeps its slot but sits out every pass, and no
mode waits for it: sequential and batched admit the next sessions as if it had left.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from braid.server.config import EngineConfig
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.types import Mode, Priority


class Slots(Protocol):
    """The KV-cache slots sessions hold while running (the runner's cache)."""

    num_slots: int

    @property
    def num_free(self) -> int: ...

    def allocate(self) -> int: ...

    def free(self, slot: int) -> None: ...


@dataclass(frozen=True)
class Work:
    """Feed `num_tokens` of `session`'s uncached tokens to the model in the next forward pass."""

    session: Session
    num_tokens: int


class Scheduler:
    def __init__(self, config: EngineConfig, cache: Slots) -> None:
        self.mode = config.mode
        self.cache = cache
        self.max_batch_size = config.max_batch_size
        self.max_wait_s = config.max_wait_ms / 1000
        self.prefill_chunk = config.prefill_chunk
        self.batch_max_wait_s = config.batch_max_wait_ms / 1000
        self.queues: dict[Priority, deque[Session]] = {p: deque() for p in Priority}
        self.running: list[Session] = []
        self._turn = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def runnable(self) -> list[Session]:
        return [s for s in self.running if not s.paused]

    def add(self, session: Session) -> None:
        self.queues[session.priority].append(session)

    def _oldest_waiting(self) -> Session | None:
        return min((q[0] for q in self.queues.values() if q), key=lambda s: s.arrived, default=None)

    def _next_waiting(self, now: float) -> Session | None:
        interactive, batch = self.queues[Priority.INTERACTIVE], self.queues[Priority.BATCH]
        if batch and (not interactive or now - batch[0].arrived >= self.batch_max_wait_s):
            return batch[0]
        return interactive[0] if interactive else None

    def remove(self, session: Session) -> None:
        """Takes a finished or cancelled session out, and frees its cache slot at once."""
        if session.status is SessionStatus.WAITING:
            self.queues[session.priority].remove(session)
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
        oldest = self._oldest_waiting()
        if self.mode is Mode.BATCHED and oldest is not None and not self.runnable:
            return max(0.0, oldest.arrived + self.max_wait_s - now)
        return None

    def _admit(self, now: float) -> None:
        if self.mode is Mode.SEQUENTIAL:
            limit = 0 if self.runnable else 1
        elif self.mode is Mode.BATCHED:
            oldest = self._oldest_waiting()
            batch_full = self.num_waiting >= self.max_batch_size
            waited = oldest is not None and now - oldest.arrived >= self.max_wait_s
            limit = self.max_batch_size if not self.runnable and (batch_full or waited) else 0
            if limit:
                for session in self._bucket(now, min(limit, self.cache.num_free)):
                    self._start(session)
            return
        else:
            limit = self.cache.num_slots
        while limit > 0 and self.cache.num_free > 0 and (session := self._next_waiting(now)) is not None:
            self._start(session)
            limit -= 1

    def _bucket(self, now: float, size: int) -> list[Session]:
        """The next session in admission order, and the waiting sessions closest to it in prompt
        length. Every decode step attends over the batch's longest context, so similar lengths
        waste less; the next session in order always goes, so no length waits for ever."""
        first = self._next_waiting(now)
        if first is None:
            return []
        others = [s for q in self.queues.values() for s in q if s is not first]
        others.sort(key=lambda s: (abs(s.num_prompt - first.num_prompt), s.arrived))
        return [first, *others[:size - 1]]

    def _start(self, session: Session) -> None:
        self.queues[session.priority].remove(session)
        session.slot = self.cache.allocate()
        session.status = SessionStatus.RUNNING
        self.running.append(session)

    def _pick(self) -> list[Work]:
        runnable = self.runnable
        if not runnable:
            return []
        if self.mode is Mode.SEQUENTIAL:
            return [self._work(runnable[0], self.prefill_chunk)]
        if self.mode is Mode.INTERLEAVED:
            self._turn = (self._turn + 1) % len(runnable)
            return [self._work(runnable[self._turn], self.prefill_chunk)]
        # batched: the whole batch's prompts go in one packed prefill; continuous: a token budget
        # per pass keeps running streams moving while a long prompt is prefilled in chunks.
        budget = None if self.mode is Mode.BATCHED else self.prefill_chunk
        work = []
        for session in self._this_turn(runnable):
            if not session.is_prefilling:
                work.append(Work(session, 1))
            elif budget is None or budget > 0:
                item = self._work(session, budget)
                budget = None if budget is None else budget - item.num_tokens
                work.append(item)
        return work

    def _this_turn(self, runnable: list[Session]) -> list[Session]:
        """The sessions of this pass: every runnable one, or max_batch_size of them in turn."""
        if len(runnable) <= self.max_batch_size:
            return runnable
        start = self._turn = (self._turn + self.max_batch_size) % len(runnable)
        return (runnable[start:] + runnable[:start])[:self.max_batch_size]

    @staticmethod
    def _work(session: Session, budget: int | None) -> Work:
        n = session.num_uncached
        return Work(session, n if budget is None else min(n, budget))
