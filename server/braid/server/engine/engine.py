"""The engine: one model thread that owns the runner and every session.

    work = scheduler.schedule(now)          # who runs, with how many tokens
    tokens = runner.run(rows(work))         # one forward pass
    self._postprocess(work, tokens)         # stop rules, text, events

Other threads talk to it only through the inbox (typed messages), admission (engine/admission.py)
and its books (engine/books.py). Its output goes through engine/output.py; what it does is reported
to an observer (engine/observer.py), which telemetry implements.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from braid.server.config import EngineConfig, parse_memory
from braid.server.engine.admission import Admission
from braid.server.engine.books import Books
from braid.server.engine.faults import FaultInjector
from braid.server.engine.grammars import Grammars, short
from braid.server.engine.observer import EngineObserver, NoObserver
from braid.server.engine.output import Output
from braid.server.engine.pages import Pages
from braid.server.engine.scheduler import Scheduler, Work
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import EngineStats, FinishReason, ModelInfo
from braid.server.runner.rows import Row, Sampled

if TYPE_CHECKING:
    from braid.server.runner.model_runner import ModelRunner

_LOGGER = logging.getLogger(__name__)
ALL_SESSIONS = -1
_IDLE_WAIT_S = 0.5  # an idle loop wakes this often (on the main thread, that is when signals run)


@dataclass
class _Add:
    session: Session


@dataclass
class _Abort:
    session_id: int
    reason: FinishReason


class _Stop:
    pass


class _Wake:
    """A paused session's client has read its backlog: look again at who can run."""


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer, model_name: str,
                 architecture: str) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_seq_len = runner.max_seq_len
        self.pages = Pages(runner.cache.num_pages, runner.cache.page_size, config.prefix_caching == "on")
        self.scheduler = Scheduler(config, self.pages)
        self.output = Output(tokenizer.eos_token_ids, self.max_seq_len)
        self.info = ModelInfo(
            model_name=model_name, architecture=architecture, context_length=self.max_seq_len,
            vocab_size=runner.vocab_size, dtype=runner.dtype_name, device=str(runner.device), mode=config.mode,
            max_batch_size=min(config.max_batch_size, config.max_sessions), eos_token_ids=tokenizer.eos_token_ids,
            has_chat_template=tokenizer.has_chat_template, parameters=runner.num_parameters,
            weight_formats=runner.weight_formats, weight_bytes=runner.weight_bytes,
            quantization=runner.quantization, kernels=runner.kernels, kv_cache_dtype=runner.kv_dtype_name,
            prefix_caching=self.pages.prefix_caching, runner=runner.path, activations=runner.activations)
        self.observer: EngineObserver = NoObserver()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}  # model thread only
        self._num_added = 0  # sessions taken from the inbox (model thread only)
        self._num_finished = 0  # and of those, finished (model thread only)
        self._num_preemptions = 0  # (model thread only)
        self._books_off: tuple[int, int] | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Callable[[], bool]]] = []
        self._waiters_lock = threading.Lock()
        self.books = Books(config.max_queued, on_change=self._notify)
        self.grammars = Grammars(tokenizer.hf_tokenizer, tokenizer.eos_token_ids, runner.vocab_size,
                                 config.constraint_compile_timeout,
                                 int(parse_memory(config.constraint_cache_memory, "constraint_cache_memory")[0]))
        # the constraint compiler's view of the vocabulary takes ~0.5 s: built now, not on a request
        threading.Thread(target=self.grammars.tokenizer, name="braid-grammar-init", daemon=True).start()
        self.faults = FaultInjector.from_env()
        self.admission = Admission(tokenizer, self.max_seq_len, self.books, runner.random_state, self.grammars,
                                   enqueue=lambda s: self._inbox.put(_Add(s)), abort=self._abort,
                                   wake=lambda: self._inbox.put(_Wake()), is_open=self._closed_because,
                                   faults=self.faults)
        self._accepting = True
        self._loop_ended = False
        self.started_at = time.monotonic()

    # ---- any thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Runs the model loop on the calling thread until stop(); `braid serve` uses the main
        thread, where torch's CPU kernels run fastest."""
        try:
            while self._step():
                pass
        except BaseException as exc:  # the engine is dead: say so, loudly, and end every session
            _LOGGER.exception("the model thread died")
            for session in list(self._sessions.values()):
                self._finish(session, FinishReason.ERROR, f"the model thread died: {exc}")
            self.output.flush()
            raise
        finally:
            self._accepting = False
            self._loop_ended = True
            for session in list(self._sessions.values()):
                self._finish(session, FinishReason.CANCELLED)
            self.output.flush()
            self._notify()

    def stop(self) -> None:
        self._accepting = False
        self._inbox.put(_Stop())

    @property
    def is_alive(self) -> bool:
        """True until the model loop ends (stopped, or dead)."""
        return not self._loop_ended

    def stop_accepting(self) -> None:
        self._accepting = False

    def _closed_because(self) -> str | None:
        if not self.is_alive:
            return "the model thread has stopped"
        return None if self._accepting else "the server is shutting down"

    def stats(self) -> EngineStats:
        return self.books.snapshot()

    def _abort(self, session_id: int, reason: FinishReason) -> None:
        self._inbox.put(_Abort(session_id, reason))

    def cancel_all(self) -> None:
        """Ends every session with a final CANCELLED message (the end of a shutdown's grace)."""
        self._inbox.put(_Abort(ALL_SESSIONS, FinishReason.CANCELLED))

    def when_idle(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future on `loop` that resolves once no session is queued or running and no call is
        being tokenized, or the model loop has ended: a drain waits on it, and nothing polls."""
        return self._wait(loop, lambda: self.books.is_idle or not self.is_alive)

    def when_stopped(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future on `loop` that resolves once the model loop has ended (stopped, or dead)."""
        return self._wait(loop, lambda: not self.is_alive)

    def _wait(self, loop: asyncio.AbstractEventLoop, done: Callable[[], bool]) -> asyncio.Future:
        future = loop.create_future()
        with self._waiters_lock:
            self._waiters.append((loop, future, done))
        self._notify()
        return future

    def _notify(self) -> None:
        """Resolves the waiters whose condition now holds (any thread; called when the books change
        and when the loop ends)."""
        with self._waiters_lock:
            ready = [w for w in self._waiters if w[2]()]
            self._waiters = [w for w in self._waiters if w not in ready]
        for loop, future, _ in ready:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            except RuntimeError:  # the loop is closed
                pass

    # ---- the model thread -------------------------------------------------------------------

    def _step(self) -> bool:
        """One turn of the loop; False once asked to stop."""
        now = time.monotonic()
        self._expire(now)
        paused = self._pause_backlogged()
        work = self.scheduler.schedule(now)  # sessions it admits start unpaused
        self._report_queue(now)
        self._num_preemptions += len(self.scheduler.take_preempted())
        self.books.set_running(len(self.scheduler.running), paused, self._cache_stats())
        if work:
            self._forward(work, now)
        self.output.flush()
        self._check_books()
        return self._drain(block_for=None if work else self._idle_wait(now))

    def _report_queue(self, now: float) -> None:
        """Queue positions for the waiting sessions that asked (interactive ones first, as admitted)."""
        for position, s in enumerate(self.scheduler.waiting_in_order(), start=1):
            if s.params.report_queue:
                self.output.queued(s, position, now)

    def _cache_stats(self) -> dict[str, int]:
        pages = self.pages
        return dict(prompt_tokens_cached=self.scheduler.num_cached_tokens, preemptions=self._num_preemptions,
                    kv_evictions=pages.num_evictions, kv_pages_total=pages.num_pages, kv_pages_used=pages.num_used,
                    kv_pages_cached=pages.num_cached, kv_page_tokens=pages.page_size)

    def _forward(self, work: list[Work], now: float) -> None:
        for w in work:
            if w.session.started is None:
                w.session.started = now
        self.faults.before_pass(work)
        try:
            self.faults.inside_pass(work)
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
        end = start + w.num_tokens
        banned: tuple[int, ...] = ()
        if s.num_generated < p.min_new_tokens and s.matcher is None:  # a constraint says where it may end
            banned = p.stop_token_ids + (() if p.ignore_eos else self.tokenizer.eos_token_ids)
        if s.bad_words and end == len(s.token_ids):
            banned += tuple(s.banned_by_bad_words())
        sample = end == len(s.token_ids)
        return Row(pages=s.pages, start=start, token_ids=s.token_ids[start:end], sample=sample,
                   sampling=s.sampling, rng=s.rng, history=s.token_ids, num_prompt=s.num_prompt, banned=banned,
                   is_prompt=s.is_prefilling, targets=s.prompt_targets(start, end),
                   matcher=s.matcher if sample else None)

    def _idle_wait(self, now: float) -> float:
        """How long the loop may block on its inbox when nothing can run: until a batch should start,
        the next deadline passes, or at most _IDLE_WAIT_S (on the main thread, signals run then)."""
        waits = [_IDLE_WAIT_S]
        hint = self.scheduler.wait_hint(now)
        if hint is not None:
            waits.append(hint)
        waits += [s.deadline - now for s in self._sessions.values() if s.deadline is not None]
        return max(0.0, min(waits))

    def _pause_backlogged(self) -> int:
        """A session whose client has not taken MAX_UNSENT_TOKENS of its output sits out the passes
        (keeping its slot) until the client reads: a client that never reads costs no compute.
        Returns how many are paused."""
        for s in self.scheduler.running:
            s.paused = s.handle.is_backlogged()
        return sum(s.paused for s in self.scheduler.running)

    def _drain(self, block_for: float | None) -> bool:
        """Applies every inbox message; waits up to block_for seconds for the first one."""
        try:
            msg = self._inbox.get(timeout=block_for) if block_for else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, _Stop):
                return False
            if isinstance(msg, _Add):
                self._sessions[msg.session.id] = msg.session
                self._num_added += 1
                self.scheduler.add(msg.session)
                reason = self.output.replay(msg.session)
                if reason is not None:  # the resumed tokens had ended it already
                    if reason is FinishReason.INVALID_REQUEST:  # admission checks them first: a backstop
                        self._finish(msg.session, reason, constraint_failure(msg.session), "resume_token_ids")
                    else:
                        self._finish(msg.session, reason)
            elif isinstance(msg, _Abort) and msg.session_id == ALL_SESSIONS:
                for session in list(self._sessions.values()):
                    self._finish(session, msg.reason)
            elif isinstance(msg, _Abort) and msg.session_id in self._sessions:
                self._finish(self._sessions[msg.session_id], msg.reason)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _expire(self, now: float) -> None:
        for session in list(self._sessions.values()):
            if session.deadline is not None and now >= session.deadline:
                self._finish(session, FinishReason.DEADLINE)

    def _check_books(self) -> None:
        """The invariant every session obeys: taken from the inbox, it is then waiting, running or
        finished, exactly one of them; and with none running, no KV-cache page is held. Cheap (a few
        lengths), so it runs after every step; a violation is a bug in braid, logged loudly (once
        per distinct imbalance)."""
        held, waiting, running = len(self._sessions), self.scheduler.num_waiting, len(self.scheduler.running)
        pages_held = 0 if running else self.pages.num_used
        balance = (held - waiting - running, self._num_added - held - self._num_finished, pages_held)
        if balance != (0, 0, 0) and balance != self._books_off:
            _LOGGER.error("BOOKS DO NOT BALANCE: %d sessions held, %d waiting + %d running; %d added, %d finished; "
                          "%d KV-cache pages held with no session running", held, waiting, running,
                          self._num_added, self._num_finished, pages_held)
        self._books_off = balance if balance != (0, 0, 0) else None

    def _postprocess(self, work: list[Work], tokens: list[Sampled | None]) -> None:
        now = time.monotonic()
        num_tokens = sum(w.num_tokens for w in work)
        self.books.count_pass(sum(w.num_tokens for w in work if w.session.is_prefilling),
                              sum(t is not None for t in tokens))
        self.observer.on_pass(len(work), num_tokens)
        for w, sampled in zip(work, tokens):
            s = w.session
            if sampled is not None and sampled.targets and s.prompt_scores is not None:
                del s.prompt_scores[s.num_cached:]  # scored again after a preemption
                s.prompt_scores.extend(sampled.targets)
            self.scheduler.computed(s, w.num_tokens)
            if sampled is None or sampled.token is None:
                continue
            if s.first_token is None:
                s.first_token = now
            reason = self.output.add_token(s, sampled.token, sampled.logprob)
            if reason is FinishReason.INVALID_REQUEST:  # only a constraint's matcher refuses a token
                self._finish(s, reason, constraint_failure(s), s.constraint_field)
            elif reason is not None:
                self._finish(s, reason)

    def _finish(self, s: Session, reason: FinishReason, error: str | None = None, field: str | None = None) -> None:
        """Ends a session; error: why (ERROR, INVALID_REQUEST), field: the request field at fault."""
        if s.status is SessionStatus.FINISHED:
            return
        self.scheduler.remove(s)
        self._sessions.pop(s.id, None)
        self._num_finished += 1
        self.observer.on_finish(self.output.finish(s, reason, error, field))
        self.books.finish(reason, active=len(self.scheduler.running), cache=self._cache_stats())


def constraint_failure(s: Session) -> str:
    """Why a session's constraint refused a token, short enough for a gRPC status."""
    return "goes past the constraint engine's limits: " + short(s.matcher.get_error() or "a token was refused")
