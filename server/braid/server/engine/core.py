"""The engine's core: synchronous and deterministic. Sessions go in (`add`, `abort`), one `step`
runs one forward pass, and the events it made come out:

    work = scheduler.schedule(now)          # who runs, with how many tokens
    tokens = runner.run(rows(work))         # one forward pass
    self._postprocess(work, tokens)         # stop rules, text, events

An embedding (engine/embedding.py) is a session like any other to the scheduler: a prompt computed
in chunks, in every mode, whose rows pool the hidden state instead of sampling; it ends, with its
vector, once its prompt is computed.

It owns the scheduler, the KV cache's pages, the output, the books' model-thread side, and the
components that keep each feature's per-session state (constraints, reasonings, the speculator),
whose entries it frees when a session ends, however it ends (`leftovers` checks). It has no thread,
no inbox and no event loop: engine/engine.py runs it on the model thread, and the tests
run it with a scripted runner (tests/unit/engine_fakes.py), a step at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from braid.server.config import EngineConfig
from braid.server.engine.adapters import Adapters
from braid.server.engine.books import Books
from braid.server.engine.constraints import Constraints
from braid.server.engine.handle import SessionHandle
from braid.server.engine.observer import EngineObserver, NoObserver
from braid.server.engine.output import Output
from braid.server.engine.kv_events import KvEventLog
from braid.server.engine.pages import Pages
from braid.server.engine.ports import Runner
from braid.server.engine.reasoning import Reasonings
from braid.server.engine.scheduler import Scheduler, Work
from braid.server.engine.session import NO_FEATURES, Features, Session, SessionStatus
from braid.server.engine.speculation import DraftProposer, NgramProposer, Speculator
from braid.server.engine.types import Event, FinishReason
from braid.server.runner.rows import Row, Sampled

_LOGGER = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # the longest an idle loop blocks (on the main thread, that is when signals run)


@dataclass
class Step:
    """What one step did: whether it ran a forward pass, and the events it made, in order."""

    ran: bool
    events: list[tuple[SessionHandle, Event]] = field(default_factory=list)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        eos_token_ids: Sequence[int],
        books: Books,
        adapters: Adapters | None = None,
        draft: Runner | None = None,
    ) -> None:
        """adapters: the LoRA adapters, whose holds a session gives back when it ends; draft:
        --speculative draft's model, on its own runner."""
        self.runner = runner
        self.adapters = adapters
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_seq_len = runner.max_seq_len
        self.kv_events = KvEventLog(config.kv_events_buffer)  # the prefix cache's pages stored and evicted
        self.pages = Pages(runner.num_pages, runner.page_size, config.prefix_caching == "on", self.kv_events)
        proposer = (
            NgramProposer(config.ngram_min, config.ngram_max)
            if config.speculative == "ngram"
            else DraftProposer(draft)
            if config.speculative == "draft" and draft is not None
            else None
        )
        self.reasonings = Reasonings()
        self.constraints = Constraints(self.reasonings)
        self.speculator = (
            Speculator(proposer, config.speculative_tokens, self.max_seq_len, self.constraints) if proposer else None
        )
        self.scheduler = Scheduler(config, self.pages, self.speculator)
        self.output = Output(self.eos_token_ids, self.max_seq_len, self.constraints, self.reasonings)
        self.books = books
        self.observer: EngineObserver = NoObserver()
        self.sessions: dict[int, Session] = {}
        self._num_added = 0  # sessions added
        self._num_finished = 0  # and of those, finished
        self._num_preemptions = 0
        self._books_off: tuple[int, int, int] | None = None

    # ---- sessions in --------------------------------------------------------------------------

    def add(self, session: Session, features: Features = NO_FEATURES) -> None:
        """Queues a session, its features' state given to their components (a resumed one replays
        its delivered tokens first, and may end there)."""
        self.sessions[session.id] = session
        self._num_added += 1
        if features.reasoning is not None:
            self.reasonings.add(session.id, features.reasoning)
        if features.matcher is not None:
            self.constraints.add(session.id, features.matcher, features.constraint_field)
        self.scheduler.add(session)
        reason = self.output.replay(session, features.resumed)
        if reason is FinishReason.INVALID_REQUEST:  # admission checks them first: a backstop
            self._finish(session, reason, self.constraints.failure(session)[0], "resume_token_ids")
        elif reason is not None:  # the resumed tokens had ended it already
            self._finish(session, reason)

    def abort(self, session_id: int, reason: FinishReason) -> None:
        """Ends a session with `reason` before the next pass; a no-op for one that has ended."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._finish(session, reason)

    def abort_all(self, reason: FinishReason, error: str | None = None) -> None:
        """Ends every session with `reason` (and `error`)."""
        for session in list(self.sessions.values()):
            self._finish(session, reason, error)

    def take_events(self) -> list[tuple[SessionHandle, Event]]:
        """The events made outside a step (by add and abort), in order."""
        return self.output.take()

    # ---- the step ----------------------------------------------------------------------------

    def step(self, now: float | None = None) -> Step:
        """Expires deadlines, pauses sessions whose clients do not read, schedules, runs at most one
        forward pass and takes its tokens; then checks the books."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        paused = self._pause_backlogged()
        work = self.scheduler.schedule(now)  # sessions it admits (or preempts) are not paused
        self._report_queue(now)
        self._num_preemptions += len(self.scheduler.take_preempted())
        self.books.set_running(len(self.scheduler.running), paused, self._cache_stats())
        if work:
            self._forward(work, now)
        self.check_books()
        return Step(ran=bool(work), events=self.output.take())

    def idle_wait(self, now: float) -> float:
        """How long the loop may wait for news when nothing can run: until a batch should start, the
        next deadline passes, or at most IDLE_WAIT_S."""
        waits = [IDLE_WAIT_S]
        hint = self.scheduler.wait_hint(now)
        if hint is not None:
            waits.append(hint)
        waits += [s.deadline - now for s in self.sessions.values() if s.deadline is not None]
        return max(0.0, min(waits))

    def _expire(self, now: float) -> None:
        for session in list(self.sessions.values()):
            if session.deadline is not None and now >= session.deadline:
                self._finish(session, FinishReason.DEADLINE)

    def _pause_backlogged(self) -> int:
        """A session whose client has not taken MAX_UNSENT_TOKENS of its output sits out the passes
        (keeping its slot) until the client reads: a client that never reads costs no compute.
        Returns how many are paused."""
        self.scheduler.paused.clear()
        for s in self.scheduler.running:
            if s.handle.is_backlogged():
                self.scheduler.pause(s)
        return len(self.scheduler.paused)

    def _report_queue(self, now: float) -> None:
        """Queue positions for the waiting sessions that asked (interactive ones first, as admitted)."""
        for position, s in enumerate(self.scheduler.waiting_in_order(), start=1):
            if s.params.report_queue:
                self.output.queued(s, position, now)

    def _cache_stats(self) -> dict[str, int]:
        pages = self.pages
        return dict(
            prompt_tokens_cached=self.scheduler.num_cached_tokens,
            preemptions=self._num_preemptions,
            kv_evictions=pages.num_evictions,
            kv_pages_total=pages.num_pages,
            kv_pages_used=pages.num_used,
            kv_pages_cached=pages.num_cached,
            kv_page_tokens=pages.page_size,
        )

    def _forward(self, work: list[Work], now: float) -> None:
        for w in work:
            if w.session.started is None:
                w.session.started = now
        try:
            tokens = self.runner.run([self._row(w) for w in work])
        except Exception as exc:  # a failed pass ends only the sessions that were in it
            _LOGGER.exception("forward pass failed")
            for w in work:
                self._finish(w.session, FinishReason.ERROR, f"forward pass failed: {exc}")
        else:
            self._postprocess(work, tokens)

    def _row(self, w: Work) -> Row:
        s, p = w.session, w.session.params
        start = s.num_cached
        end = start + w.num_tokens - len(w.proposals)  # the session's own tokens; then the proposals
        banned: tuple[int, ...] = ()
        matcher = self.constraints.of(s)
        if s.num_generated < p.min_new_tokens and matcher is None:  # a constraint says where it may end
            banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        if s.bad_words and end == len(s.token_ids):
            banned += tuple(s.banned_by_bad_words())
        sample = end == len(s.token_ids) and s.embedding is None
        reasoning = self.reasonings.of(s)
        # at the opening, a constrained output may open a reasoning of the model's own instead
        also_allowed = reasoning.opening_tokens() if reasoning is not None and matcher is not None else ()
        return Row(
            pages=s.pages,
            start=start,
            token_ids=s.token_ids[start:end] + list(w.proposals),
            sample=sample,
            sampling=s.params,
            rng=s.rng,
            history=s.token_ids,
            num_prompt=s.num_prompt,
            banned=banned,
            is_prompt=s.is_prefilling,
            targets=s.prompt_targets(start, end),
            matcher=matcher if sample else None,
            also_allowed=also_allowed if sample else (),
            adapter=s.adapter,
            num_proposals=len(w.proposals),
            pool=s.embedding.pooled_by(end, s.num_prompt) if s.embedding is not None else None,
        )

    def _postprocess(self, work: list[Work], tokens: list[Sampled | None]) -> None:
        now = time.monotonic()
        num_tokens = sum(w.num_tokens for w in work)
        proposed = sum(len(w.proposals) for w in work)
        accepted = sum(len(t.more) for w, t in zip(work, tokens) if w.proposals and t is not None)
        prompt_tokens = sum(w.num_tokens for w in work if w.session.is_prefilling)
        generated = sum(w.session.num_generated for w in work)
        self.observer.on_pass(len(work), num_tokens)
        for w, sampled in zip(work, tokens):
            s = w.session
            if sampled is not None and sampled.targets and s.prompt_scores is not None:
                del s.prompt_scores[s.num_cached :]  # scored again after a preemption
                s.prompt_scores.extend(sampled.targets)
            if w.proposals:
                assert sampled is not None and sampled.token is not None  # a speculating row always samples
                self._take_verified(w, sampled, now)
                continue
            self.scheduler.computed(s, w.num_tokens)
            if s.embedding is not None:
                self._pooled(w, sampled)
                continue
            if sampled is None or sampled.token is None:
                continue
            if s.first_token is None:
                s.first_token = now
            reasoning = self.reasonings.of(s)
            if reasoning is not None and reasoning.forced():  # a marker's tokens instead (Reasoning.forced)
                self._end_if(s, self.output.add_forced(s, sampled.logprob is not None))
            else:
                self._end_if(s, self.output.add_token(s, sampled.token, sampled.logprob))
        # tokens kept: a stop among a row's confirmed proposals drops those after it
        generated = sum(w.session.num_generated for w in work) - generated
        self.books.count_pass(prompt_tokens, generated, proposed, accepted)

    def _pooled(self, w: Work, sampled: Sampled | None) -> None:
        """An embedding session's chunk: its pooled state added; the session ends with its vector
        once its whole input is computed (as a generation of max_new_tokens 0: MAX_TOKENS)."""
        s = w.session
        assert s.embedding is not None
        if sampled is not None and sampled.pooled is not None:
            s.embedding.add(sampled.pooled, s.num_cached - w.num_tokens, w.num_tokens)
        if s.num_cached >= s.num_prompt:
            self._finish(s, FinishReason.MAX_TOKENS)

    def _take_verified(self, w: Work, sampled: Sampled, now: float) -> None:
        """A speculating row's tokens: the proposals the runner confirmed, then the one it sampled
        where they stopped. The cache keeps the keys and values of the last token and the confirmed
        proposals; the rejected ones' are written over later, and pages grown only for them are
        freed. A stop among the tokens ends the session there, the rest unsent."""
        s = w.session
        if s.first_token is None:
            s.first_token = now
        assert sampled.token is not None and self.speculator is not None  # only a speculator proposes
        picked = [(sampled.token, sampled.logprob), *sampled.more]
        accepted = len(sampled.more)
        self.speculator.verified(self.speculator.of(s), len(w.proposals), accepted)
        fed = w.num_tokens - len(w.proposals)
        reason, taken, forced = None, 0, False
        reasoning = self.reasonings.of(s)
        for token, logprob in picked:
            if reasoning is not None and reasoning.forced():
                # at its budget the reasoning closes with its end marker, which is no proposal: the
                # token sampled here, and the rest, are dropped (the end marker's keys come next pass)
                reason, forced = self.output.add_forced(s, logprob is not None), True
                break
            reason = self.output.add_token(s, token, logprob)
            taken += 1
            # a reasoning that closes ends what the pass verified: its constraint (if any) did not
            # check the tokens after, and a forced end marker must not follow them
            if reason is not None or (reasoning is not None and reasoning.closed_now):
                break
        # named pages are keyed by the tokens they hold: counted computed only once they are appended;
        # a session that goes on feeds its last token next pass (unless forced tokens follow it)
        kept = taken if reason is not None or forced else taken - 1
        self.scheduler.computed(s, fed + min(accepted, kept))
        if reason is None:
            self.pages.shrink(s, s.num_cached)
        self._end_if(s, reason)

    def _end_if(self, s: Session, reason: FinishReason | None) -> None:
        if reason is FinishReason.INVALID_REQUEST:  # only a constraint's matcher refuses a token
            self._finish(s, reason, *self.constraints.failure(s))
        elif reason is not None:
            self._finish(s, reason)

    def _finish(self, s: Session, reason: FinishReason, error: str | None = None, field: str | None = None) -> None:
        """Ends a session; error: why (ERROR, INVALID_REQUEST), field: the request field at fault."""
        if s.status is SessionStatus.FINISHED:
            return
        self.scheduler.remove(s)
        speculation = self.speculator.release(s) if self.speculator is not None else None
        self.sessions.pop(s.id, None)
        self._num_finished += 1
        if s.adapter and self.adapters is not None:
            self.adapters.release(s.adapter)
        finished = self.output.finish(s, reason, error, field, speculation)  # its last text, split by its reasoning
        self.constraints.release(s)
        self.reasonings.release(s)
        self.observer.on_finish(finished)
        self.books.finish(reason, active=len(self.scheduler.running), cache=self._cache_stats())

    def kept(self) -> dict[str, set[int]]:
        """The ids of the sessions each component keeps per-feature state for."""
        speculator = self.speculator.session_ids() if self.speculator is not None else set()
        return dict(
            constraints=self.constraints.session_ids(),
            reasonings=self.reasonings.session_ids(),
            speculator=speculator,
            output=self.output.session_ids(),
            paused=set(self.scheduler.paused),
        )

    def leftovers(self) -> dict[str, set[int]]:
        """The ids of sessions that have ended whose state a component still keeps, by component:
        {} while every component frees a session's entries when it ends, however it ends. A few
        set operations per session: for tests, which check it after every step."""
        held = set(self.sessions)
        return {name: ids - held for name, ids in self.kept().items() if ids - held}

    # ---- the books ---------------------------------------------------------------------------

    def books_balance(self) -> tuple[int, int, int]:
        """(0, 0, 0) while every session added is waiting, running or finished, exactly one of them,
        and no KV-cache page is held with none running; else how far off each is."""
        return self._balance(*self._counts())

    def _counts(self) -> tuple[int, int, int]:
        """Sessions held, waiting and running."""
        return len(self.sessions), self.scheduler.num_waiting, len(self.scheduler.running)

    def _balance(self, held: int, waiting: int, running: int) -> tuple[int, int, int]:
        pages_held = 0 if running else self.pages.num_used
        return held - waiting - running, self._num_added - held - self._num_finished, pages_held

    def check_books(self) -> None:
        """Cheap (a few lengths), so it runs after every step; a violation is a bug in braid, logged
        loudly (once per distinct imbalance)."""
        held, waiting, running = self._counts()
        balance = self._balance(held, waiting, running)
        if balance != (0, 0, 0) and balance != self._books_off:
            _LOGGER.error(
                "BOOKS DO NOT BALANCE: %d sessions held, %d waiting + %d running; %d added, %d finished; "
                "%d KV-cache pages held with no session running",
                held,
                waiting,
                running,
                self._num_added,
                self._num_finished,
                balance[2],
            )
        self._books_off = balance if balance != (0, 0, 0) else None
