"""The engine: one model thread that owns the model, its KV cache and every session.

    work = scheduler.schedule(now)       # who runs, with how many tokens
    tokens = runner.run(work)            # one forward pass
    self._postprocess(work, tokens)      # detokenize, stop, stream out

Other threads talk to it only through the inbox (typed messages) and read only its counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from braid.server.config import EngineConfig
from braid.server.config import parse_memory
from braid.server.engine.books import Books, Ticket
from braid.server.engine.detokenizer import IncrementalDetokenizer
from braid.server.engine.faults import FaultInjector
from braid.server.engine.handle import SessionHandle
from braid.server.engine.scheduler import Scheduler
from braid.server.engine.session import Session, SessionStatus
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import (Delta, EngineStats, EngineUnavailable, Event, FinishReason, Finished,
                                       GenerationRequest, InvalidArgument, Message, ModelInfo, Timings)
from braid.server.model.loader import LoadedModel
from braid.server.runner.kv_cache import KVCache, free_memory
from braid.server.runner.model_runner import ModelRunner, Work, pick_device
from braid.server.telemetry.metrics import record_finish, record_pass

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
    def __init__(self, config: EngineConfig, model: LoadedModel) -> None:
        self.config = config
        device, dtype = pick_device(config.device)
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        context = getattr(model.hf_model.config, "max_position_embeddings", None) or 2048
        self.max_seq_len = min(config.max_seq_len, context)
        num_slots = _fit_slots(config, model, self.max_seq_len, device, dtype)
        self.runner = ModelRunner(model, device, dtype, num_slots, self.max_seq_len,
                                  allow_kernels=config.kernels == "auto")
        self.tokenizer = Tokenizer(model.hf_tokenizer, model.eos_token_ids)
        self.scheduler = Scheduler(config.mode, self.runner.cache, config.max_batch_size,
                                   config.max_wait_ms / 1000, config.prefill_chunk,
                                   config.batch_max_wait_ms / 1000)
        self.info = ModelInfo(
            model_name=model.name, architecture=model.architecture, context_length=self.max_seq_len,
            vocab_size=self.runner.vocab_size, dtype=str(dtype).removeprefix("torch."), device=str(device),
            mode=config.mode, max_batch_size=min(config.max_batch_size, num_slots), eos_token_ids=model.eos_token_ids,
            has_chat_template=self.tokenizer.has_chat_template, parameters=self.runner.num_parameters)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}  # model thread only
        self._num_added = 0  # sessions taken from the inbox (model thread only)
        self._num_finished = 0  # and of those, finished (model thread only)
        self._books_off: tuple[int, int] | None = None
        self._ids = itertools.count(1)
        self.books = Books(config.max_queued)
        self._outbox: list[tuple[SessionHandle, list[Event]]] = []
        self._thread = threading.Thread(target=self._run, name="braid-model", daemon=True)
        self._accepting = True
        self._loop_ended = False
        self.faults = FaultInjector.from_env()
        self.started_at = time.monotonic()
        self.error: BaseException | None = None

    # ---- any thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Runs the model loop on a thread of its own (for embedding the engine in a process)."""
        self._thread.start()

    def run(self) -> None:
        """Runs the model loop on the calling thread until stop(); `braid serve` uses the main
        thread, where torch's CPU kernels run fastest."""
        self._run()

    def stop(self, timeout: float | None = None) -> None:
        self._accepting = False
        self._inbox.put(_Stop())
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """True until the model loop ends (stopped, or dead)."""
        return not self._loop_ended

    def stop_accepting(self) -> None:
        self._accepting = False

    def admit(self, prompt: str | None, messages: Sequence[Message], for_session: bool = True) -> Ticket:
        """Takes a place for a call before its text is tokenized: cheap, so the event loop calls it
        the moment a call arrives. A Stream prompt that cannot fit in the context even at the most
        bytes per token is refused here, without tokenizing it."""
        if not self._accepting or not self.is_alive:
            raise EngineUnavailable("the server is shutting down" if self.is_alive
                                    else "the model thread has stopped")
        if for_session:
            at_least = self.tokenizer.min_tokens(prompt, messages)
            if at_least >= self.max_seq_len:
                raise InvalidArgument("messages" if messages else "prompt",
                                      f"is at least {at_least} tokens; the context length is {self.max_seq_len}")
        return Ticket(self.books)

    def submit(self, ticket: Ticket, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> SessionHandle:
        """Tokenizes, checks and queues a session; gives the ticket back whatever happens. Blocking
        (tokenization): call it off the event loop."""
        try:
            session = self._session(request, loop)
            ticket.release(submitted=True)  # counted before the model thread can finish it
        finally:
            ticket.release()
        self._inbox.put(_Add(session))
        return session.handle

    def _session(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Session:
        prompt_ids = self.tokenizer.encode(request.prompt, request.messages)
        params = request.params
        field = "messages" if request.messages else "prompt"
        if not prompt_ids:
            raise InvalidArgument(field, "must not be empty")
        if len(prompt_ids) >= self.max_seq_len:
            raise InvalidArgument(field, f"is {len(prompt_ids)} tokens; the context length is "
                                         f"{self.max_seq_len}")
        room = self.max_seq_len - len(prompt_ids)
        if params.max_new_tokens > room and params.clip_max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        if params.max_new_tokens > room:
            raise InvalidArgument("max_new_tokens",
                                  f"{params.max_new_tokens} new tokens after a {len(prompt_ids)}-token prompt "
                                  f"exceed the context length {self.max_seq_len} (at most {room})")
        if params.min_new_tokens > params.max_new_tokens:
            raise InvalidArgument("min_new_tokens",
                                  f"{params.min_new_tokens} is more than the {room} new tokens that fit after a "
                                  f"{len(prompt_ids)}-token prompt (context length {self.max_seq_len})")
        session_id = next(self._ids)
        handle = SessionHandle(session_id, request.request_id, params.seed, len(prompt_ids), loop,
                               self._abort, self._wake)
        return Session(
            id=session_id, prompt_ids=prompt_ids, params=params, handle=handle,
            detokenizer=IncrementalDetokenizer(self.tokenizer.decode, prompt_ids, params.stop),
            rng=torch.Generator().manual_seed(params.seed), deadline=request.deadline,
            priority=request.priority, arrived=handle.arrived)

    def tokenize(self, ticket: Ticket, prompt: str | None, messages: Sequence[Message]) -> tuple[list[int], list[str]]:
        """A Tokenize call's work; gives the ticket back. Blocking: call it off the event loop."""
        try:
            ids = self.tokenizer.encode(prompt, messages)
            return ids, self.tokenizer.pieces(ids)
        finally:
            ticket.release()

    def stats(self) -> EngineStats:
        return self.books.snapshot()

    def _wake(self) -> None:
        self._inbox.put(_Wake())

    def _abort(self, session_id: int, reason: FinishReason) -> None:
        self._inbox.put(_Abort(session_id, reason))

    def cancel_all(self) -> None:
        """Ends every session with a final CANCELLED message (the end of a shutdown's grace)."""
        self._inbox.put(_Abort(ALL_SESSIONS, FinishReason.CANCELLED))

    # ---- the model thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:  # the engine is dead: say so, loudly, and end every session
            self.error = exc
            _LOGGER.exception("the model thread died")
            for session in list(self._sessions.values()):
                self._finish(session, FinishReason.ERROR, f"the model thread died: {exc}")
            self._flush()
            raise
        finally:
            self._accepting = False
            self._loop_ended = True
            for session in list(self._sessions.values()):
                self._finish(session, FinishReason.CANCELLED)
            self._flush()

    def _step(self) -> bool:
        """One turn of the loop; False once asked to stop."""
        now = time.monotonic()
        self._expire(now)
        self._pause_backlogged()
        work = self.scheduler.schedule(now)
        self.books.set_running(len(self.scheduler.running), sum(s.paused for s in self.scheduler.running))
        if work:
            self._forward(work, now)
        self._flush()
        self._check_books()
        return self._drain(block_for=None if work else self._idle_wait(now))

    def _forward(self, work: list[Work], now: float) -> None:
        for w in work:
            if w.session.started is None:
                w.session.started = now
        self.faults.before_pass(work)
        try:
            self.faults.inside_pass(work)
            tokens = self.runner.run(work)
        except Exception as exc:  # a failed pass ends only the sessions that were in it
            _LOGGER.exception("forward pass failed")
            for w in work:
                self._finish(w.session, FinishReason.ERROR, f"forward pass failed: {exc}")
        else:
            self._postprocess(work, tokens)

    def _idle_wait(self, now: float) -> float:
        """How long the loop may block on its inbox when nothing can run: until a batch should start,
        the next deadline passes, or at most _IDLE_WAIT_S (on the main thread, signals run then)."""
        waits = [_IDLE_WAIT_S]
        hint = self.scheduler.wait_hint(now)
        if hint is not None:
            waits.append(hint)
        waits += [s.deadline - now for s in self._sessions.values() if s.deadline is not None]
        return max(0.0, min(waits))

    def _pause_backlogged(self) -> None:
        """A session whose client has not taken MAX_UNSENT_TOKENS of its output sits out the passes
        (keeping its slot) until the client reads: a client that never reads costs no compute."""
        for s in self.scheduler.running:
            s.paused = s.handle.is_backlogged()

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
        finished, exactly one of them. Cheap (a few lengths), so it runs after every step; a
        violation is a bug in braid, logged loudly (once per distinct imbalance)."""
        held, waiting, running = len(self._sessions), self.scheduler.num_waiting, len(self.scheduler.running)
        balance = (held - waiting - running, self._num_added - held - self._num_finished)
        if balance != (0, 0) and balance != self._books_off:
            _LOGGER.error("BOOKS DO NOT BALANCE: %d sessions held, %d waiting + %d running; %d added, %d finished",
                          held, waiting, running, self._num_added, self._num_finished)
        self._books_off = balance if balance != (0, 0) else None

    def _postprocess(self, work: list[Work], tokens: list[int | None]) -> None:
        now = time.monotonic()
        self.books.count_pass(sum(w.num_tokens for w in work if w.session.is_prefilling),
                              sum(t is not None for t in tokens))
        record_pass(len(work), sum(w.num_tokens for w in work))
        for w, token in zip(work, tokens):
            s = w.session
            s.num_cached += w.num_tokens
            if token is None:
                continue
            s.token_ids.append(token)
            s.pending_ids.append(token)
            if s.first_token is None:
                s.first_token = now
            reason = self._check_stop(s, token)
            if reason is not None:
                self._finish(s, reason)
            else:
                self._emit(s, Delta(s.detokenizer.take(), s.pending_ids))

    def _check_stop(self, s: Session, token: int) -> FinishReason | None:
        p = s.params
        if token in p.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if token in self.tokenizer.eos_token_ids and not p.ignore_eos:
            return FinishReason.EOS
        s.detokenizer.add(token)
        if s.detokenizer.stopped:
            return FinishReason.STOP_SEQUENCE
        if s.num_generated >= p.max_new_tokens or len(s.token_ids) >= self.max_seq_len:
            return FinishReason.MAX_TOKENS
        return None

    def _emit(self, s: Session, event: Event) -> None:
        if isinstance(event, Delta):
            if not event.text and not event.token_ids:
                return
            s.pending_ids = []
            s.handle.note_emitted(len(event.token_ids))
        self._outbox.append((s.handle, [event]))

    def _finish(self, s: Session, reason: FinishReason, error: str | None = None) -> None:
        if s.status is SessionStatus.FINISHED:
            return
        self.scheduler.remove(s)
        self._sessions.pop(s.id, None)
        self._num_finished += 1
        self.books.finish(reason, active=len(self.scheduler.running))
        # Whatever the reason, the text so far goes out: the tail held back in case it began a stop
        # string, and tokens not yet delivered (a deadline ends the stream "with the text so far").
        self._emit(s, Delta(s.detokenizer.take(final=True), s.pending_ids))
        finished = Finished(reason=reason, prompt_tokens=s.num_prompt, generated_tokens=s.num_generated,
                            timings=_timings(s), error=error)
        record_finish(finished)
        self._emit(s, finished)

    def _flush(self) -> None:
        """Hands this step's events to the event loops: one wake-up per loop per step."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[SessionHandle, list[Event]]]] = {}
        for handle, events in self._outbox:
            by_loop.setdefault(handle.loop, []).append((handle, events))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _fit_slots(config: EngineConfig, model: LoadedModel, max_seq_len: int, device: torch.device,
               dtype: torch.dtype) -> int:
    """KV-cache slots: --max-sessions, or fewer where the --kv-cache-memory budget holds fewer.
    The cache is reserved at start, so the scheduler can never admit more than fits."""
    cfg = model.hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_slot = max_seq_len * KVCache.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                     head_dim, dtype)
    amount, is_fraction = parse_memory(config.kv_cache_memory)
    budget = amount * free_memory(device) if is_fraction else amount
    slots = min(config.max_sessions, int(budget // per_slot))
    if slots < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory}: one session of --max-seq-len "
                         f"{max_seq_len} tokens needs {per_slot / 2**20:.0f} MiB")
    if slots < config.max_sessions:
        _LOGGER.warning("KV cache budget fits %d sessions of %d tokens, not --max-sessions %d", slots,
                        max_seq_len, config.max_sessions)
    _LOGGER.info("KV cache: %d slots x %d tokens, %.0f MiB", slots, max_seq_len, slots * per_slot / 2**20)
    return slots


def _deliver(items: list[tuple[SessionHandle, list[Event]]]) -> None:
    for handle, events in items:
        handle.push(events)


def _timings(s: Session) -> Timings:
    now = time.monotonic()
    ms = 1000.0
    started = s.started if s.started is not None else now
    first = s.first_token if s.first_token is not None else now
    decode_s = now - first
    rate = (s.num_generated - 1) / decode_s if s.num_generated > 1 and decode_s > 0 else 0.0
    return Timings(queue_ms=(started - s.arrived) * ms, time_to_first_token_ms=(first - s.arrived) * ms,
                   total_ms=(now - s.arrived) * ms, tokens_per_second=rate)
