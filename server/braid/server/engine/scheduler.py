"""The scheduler: which sessions run in the next forward pass, and with how many tokens.

The four modes share everything else; they differ only in `_admit` (who is admitted to run) and
`_pick` (whose tokens go into the pass):

- sequential: one session holds the model until it finishes.
- interleaved: every admitted session runs; one session per pass, round robin.
- batched: waiting sessions are gathered (up to max_batch_size, or max_wait), bucketed by prompt
  length, and run together: prompts in one packed prefill, then decode steps, until the whole
  batch has left.
- continuous: sessions join the running batch at every step and leave the moment they finish.

Admission order is the same in every mode: interactive sessions first, except that a batch session
that has waited `batch_max_wait_s` goes next, so batch work waits a bounded time, never forever.
A pass holds at most `max_batch_size` sessions; when more are running (--max-sessions is larger),
batched and continuous passes take turns over them.

A *paused* session (its client has stopped reading: `pause`) keeps its pages but sits out every
pass, and no mode waits for it: sequential and batched admit the next sessions as if it had left.

Memory is the KV cache's pages (engine/pages.py). A session is admitted when the pages its tokens
need now (less the prefix already cached) leave one page free per running session, at most
--max-sessions at once. When a running session needs a page and none is left, the scheduler
*preempts* one: the lowest priority first, then the newest. Its pages are released (its full ones
stay cached) and it goes back to the head of its queue, to recompute its tokens when it is admitted
again. Its stream only pauses: a session admitted is never failed for memory.

With --speculative, decoding sessions may add proposals to their rows (engine/speculation.py), in
every mode, into what a pass has left of SPECULATION_PASS_TOKENS: proposals go first when a pass
is full, so speculation never makes a loaded server's passes longer. They are dropped too where
their pages would need a preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from braid.server.config import SchedulerConfig
from braid.server.engine.pages import Pages
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.speculation import Speculator
from braid.server.engine.types import Mode, Priority

# Tokens a pass may reach with proposals. On a CPU a pass reads every weight once whatever its rows,
# so a pass of a few rows costs about what one row costs; past this, proposals would lengthen it.
SPECULATION_PASS_TOKENS = 16


@dataclass(frozen=True)
class Work:
    """Feed `num_tokens` of `session`'s uncached tokens to the model in the next forward pass; the
    last len(proposals) of them are speculative proposals to verify, not yet the session's tokens."""

    session: Session
    num_tokens: int
    proposals: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: Pages, speculator: Speculator | None = None) -> None:
        self.mode = config.mode
        self.pages = pages
        self.speculator = speculator
        self.max_sessions = config.max_sessions
        self.max_batch_size = config.max_batch_size
        self.max_wait_s = config.max_wait_ms / 1000
        self.prefill_chunk = config.prefill_chunk
        self.batch_max_wait_s = config.batch_max_wait_ms / 1000
        self.queues: dict[Priority, deque[Session]] = {p: deque() for p in Priority}
        self.running: list[Session] = []
        self.held: list[Session] = []  # samples 1.. of a request (n > 1) until sample 0 has the prompt
        self.preempted: list[Session] = []  # since the engine last took them (take_preempted)
        self.paused: set[int] = set()  # ids of running sessions whose clients have not read their output
        self.num_cached_tokens = 0  # tokens admitted sessions found in the prefix cache, since start
        self._turn = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values()) + len(self.held)

    @property
    def runnable(self) -> list[Session]:
        return [s for s in self.running if s.id not in self.paused]

    def waiting_in_order(self) -> list[Session]:
        """The waiting sessions, interactive first (the order admission mostly takes them in)."""
        return [s for p in Priority for s in self.queues[p]] + self.held

    def add(self, session: Session) -> None:
        if session.parent is not None and self._computing_prompt(session.parent):
            self.held.append(session)
        else:
            self.queues[session.priority].append(session)

    @staticmethod
    def _computing_prompt(parent: Session | None) -> bool:
        return (
            parent is not None and parent.status is not SessionStatus.FINISHED and parent.num_cached < parent.num_prompt
        )

    def _release_held(self) -> None:
        """Samples whose sample 0 has computed the prompt (or ended) join the head of their queue:
        admitted now, they find the prompt's pages in the prefix cache instead of computing them."""
        ready = [s for s in self.held if not self._computing_prompt(s.parent)]
        for s in reversed(ready):
            self.held.remove(s)
            self.queues[s.priority].appendleft(s)

    def _oldest_waiting(self) -> Session | None:
        return min((q[0] for q in self.queues.values() if q), key=lambda s: s.arrived, default=None)

    def _next_waiting(self, now: float) -> Session | None:
        interactive, batch = self.queues[Priority.INTERACTIVE], self.queues[Priority.BATCH]
        if batch and (not interactive or now - batch[0].arrived >= self.batch_max_wait_s):
            return batch[0]
        return interactive[0] if interactive else None

    def pause(self, session: Session) -> None:
        """A running session sits out the passes, keeping its pages, until `paused` is cleared (the
        engine core looks again at every step) or it is preempted."""
        self.paused.add(session.id)

    def remove(self, session: Session) -> None:
        """Takes a finished or cancelled session out, and releases its pages at once."""
        if session.status is SessionStatus.WAITING and session in self.held:
            self.held.remove(session)
        elif session.status is SessionStatus.WAITING:
            self.queues[session.priority].remove(session)
        elif session.status is SessionStatus.RUNNING:
            self.running.remove(session)
            self.pages.release(session)
            self.paused.discard(session.id)
        session.status = SessionStatus.FINISHED

    def schedule(self, now: float) -> list[Work]:
        if self.held:
            self._release_held()
        self._admit(now)
        return self._grow(self._speculate(self._pick()))

    def computed(self, session: Session, num_tokens: int) -> None:
        """A pass computed `num_tokens` more of the session's tokens: its full pages get named."""
        before = session.num_cached
        session.num_cached += num_tokens
        self.pages.commit(session, before)

    def take_preempted(self) -> list[Session]:
        preempted, self.preempted = self.preempted, []
        return preempted

    def wait_hint(self, now: float) -> float | None:
        """Seconds the model thread may sleep before a batch should start (batched mode)."""
        oldest = self._oldest_waiting()
        if self.mode is Mode.BATCHED and oldest is not None and not self.runnable:
            return max(0.0, oldest.arrived + self.max_wait_s - now)
        return None

    def _admit(self, now: float) -> None:
        room = self.max_sessions - len(self.running)
        if self.mode is Mode.SEQUENTIAL:
            limit = 0 if self.runnable else 1
        elif self.mode is Mode.BATCHED:
            oldest = self._oldest_waiting()
            batch_full = self.num_waiting >= self.max_batch_size
            waited = oldest is not None and now - oldest.arrived >= self.max_wait_s
            limit = self.max_batch_size if not self.runnable and (batch_full or waited) else 0
            for session in self._bucket(now, min(limit, room)):
                if not self._start(session):
                    break
            return
        else:
            limit = room
        limit = min(limit, room)
        while limit > 0 and (waiting := self._next_waiting(now)) is not None and self._start(waiting):
            limit -= 1

    def _bucket(self, now: float, size: int) -> list[Session]:
        """The next session in admission order, and the waiting sessions closest to it in prompt
        length. Every decode step attends over the batch's longest context, so similar lengths
        waste less; the next session in order always goes, so no length waits for ever."""
        first = self._next_waiting(now)
        if first is None or size < 1:
            return []
        others = [s for q in self.queues.values() for s in q if s is not first]
        others.sort(key=lambda s: (abs(s.num_prompt - first.num_prompt), s.arrived))
        return [first, *others[: size - 1]]

    def _start(self, session: Session) -> bool:
        """Admits the session if its pages fit, leaving one page of room per running session."""
        if not self.pages.admit(session, reserve=len(self.running)):
            return False
        if session.cached_tokens is None:
            session.cached_tokens = session.num_cached
        self.num_cached_tokens += session.num_cached
        self.queues[session.priority].remove(session)
        session.status = SessionStatus.RUNNING
        self.running.append(session)
        return True

    def _grow(self, work: list[Work]) -> list[Work]:
        """Pages for every new token of the pass. Where none are left, sessions are preempted until
        they fit; one preempted leaves the pass (it may be the very session that needed the page).
        Proposals whose pages are not available are dropped first: they never preempt."""
        for i, w in enumerate(work):
            if w.session.status is not SessionStatus.RUNNING:  # preempted for an earlier one's pages
                continue
            if w.proposals and not self.pages.grow(w.session, w.num_tokens):
                work[i] = w = Work(w.session, w.num_tokens - len(w.proposals))
            while w.session.status is SessionStatus.RUNNING and not self.pages.grow(w.session, w.num_tokens):
                self._preempt(max(self.running, key=lambda s: (s.priority.value, s.arrived)))
        return [w for w in work if w.session.status is SessionStatus.RUNNING]

    def _preempt(self, session: Session) -> None:
        """Takes a running session's pages back: it waits at the head of its queue, to recompute
        its tokens (those of its full pages still cached are found again) when admitted again."""
        self.running.remove(session)
        self.pages.release(session)
        session.num_cached = 0
        session.status = SessionStatus.WAITING
        self.paused.discard(session.id)
        session.preemptions += 1
        self.queues[session.priority].appendleft(session)
        self.preempted.append(session)

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

    def _speculate(self, work: list[Work]) -> list[Work]:
        """Proposals for the decoding sessions of the pass, in what it leaves of SPECULATION_PASS_TOKENS."""
        budget = SPECULATION_PASS_TOKENS - sum(w.num_tokens for w in work)
        if self.speculator is None or budget <= 0:
            return work
        asks: list[tuple[int, int]] = []  # (index in work, proposals it may make)
        for i, w in enumerate(work):
            if budget > 0 and w.num_tokens == 1 and not w.session.is_prefilling:
                k = self.speculator.wants(w.session, budget)
                if k:
                    asks.append((i, k))
                    budget -= k
        found = self.speculator.propose([(work[i].session, k) for i, k in asks]) if asks else []
        for (i, _), proposals in zip(asks, found):
            if proposals:
                work[i] = Work(work[i].session, 1 + len(proposals), proposals)
        return work

    def _this_turn(self, runnable: list[Session]) -> list[Session]:
        """The sessions of this pass: every runnable one, or max_batch_size of them in turn."""
        if len(runnable) <= self.max_batch_size:
            return runnable
        start = self._turn = (self._turn + self.max_batch_size) % len(runnable)
        return (runnable[start:] + runnable[:start])[: self.max_batch_size]

    @staticmethod
    def _work(session: Session, budget: int | None) -> Work:
        n = session.num_uncached
        return Work(session, n if budget is None else min(n, budget))
