"""The engine's loop: one model thread that runs the core (engine/core.py) and talks to the rest.

    while running:
        step = core.step()                  # one forward pass, its events
        deliver(step.events)                # to the sessions' event loops
        apply the inbox                     # sessions added and aborted, by other threads

Other threads talk to it only through the inbox (typed messages), admission (engine/admission.py)
and its books (engine/books.py). What it does is reported to an observer (engine/observer.py),
which telemetry implements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from braid.server.config import EngineConfig
from braid.server.engine.adapters import Adapters
from braid.server.engine.admission import Admission
from braid.server.engine.books import Books, Ticket
from braid.server.engine.core import EngineCore
from braid.server.engine.grammars import Grammars, Matcher
from braid.server.engine.handle import SessionHandle
from braid.server.engine.observer import EngineObserver
from braid.server.engine.output import deliver
from braid.server.engine.ports import Runner
from braid.server.engine.session import Session
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import EmbeddingRequest, EngineStats, FinishReason, GenerationRequest, Message, ModelInfo
from braid.server.runner.rows import AdapterInfo

_LOGGER = logging.getLogger(__name__)
ALL_SESSIONS = -1


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
    """The model loop around an EngineCore, and what other threads call: admission, stats, waiters."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer: Tokenizer,
        info: ModelInfo,
        grammars: Grammars,
        draft: Runner | None = None,
    ) -> None:
        """info: what ModelInfo reports, and grammars: the constraint compiler (the composition root
        makes both); draft: --speculative draft's runner."""
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self.max_seq_len = runner.max_seq_len
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop | _Wake] = queue.SimpleQueue()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], Callable[[], bool]]] = []
        self._waiters_lock = threading.Lock()
        self.books = Books(config.max_queued, on_change=self._notify)
        self.adapters = Adapters(
            runner, config.max_loras, config.max_lora_rank, info.served_model_names or (info.model_name,)
        )
        self.core = EngineCore(config, runner, tokenizer.eos_token_ids, self.books, self.adapters, draft)
        self.kv_events = self.core.kv_events
        self.grammars = grammars
        # the constraint compiler's view of the vocabulary takes ~0.5 s: built now, not on a request
        threading.Thread(target=self.grammars.tokenizer, name="braid-grammar-init", daemon=True).start()
        self.admission = Admission(
            tokenizer,
            self.max_seq_len,
            self.books,
            runner.random_state,
            self.grammars,
            enqueue=lambda s: self._inbox.put(_Add(s)),
            abort=self._abort,
            wake=lambda: self._inbox.put(_Wake()),
            is_open=self._closed_because,
            adapters=self.adapters,
        )
        self._accepting = True
        self._loop_ended = False
        self.started_at = time.monotonic()

    @property
    def observer(self) -> EngineObserver:
        return self.core.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self.core.observer = observer

    # ---- any thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Runs the model loop on the calling thread until stop(); `braid serve` uses the main
        thread, where torch's CPU kernels run fastest."""
        try:
            while self._turn():
                pass
        except BaseException as exc:  # the engine is dead: say so, loudly, and end every session
            _LOGGER.exception("the model thread died")
            self.core.abort_all(FinishReason.ERROR, f"the model thread died: {exc}")
            deliver(self.core.take_events())
            raise
        finally:
            self._accepting = False
            self._loop_ended = True
            self.core.abort_all(FinishReason.CANCELLED)
            deliver(self.core.take_events())
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

    # ---- the EngineClient port (engine/client.py): what front ends call ------------------------

    @property
    def max_sessions(self) -> int:
        return self.config.max_sessions

    @property
    def is_idle(self) -> bool:
        return self.books.is_idle

    def admit(
        self,
        prompt: str | None,
        messages: Sequence[Message],
        for_session: bool = True,
        truncated: bool = False,
        token_ids: Sequence[int] = (),
    ) -> Ticket:
        return self.admission.admit(prompt, messages, for_session, truncated, token_ids)

    def compile(self, request: GenerationRequest) -> Matcher | None:
        return self.admission.compile(request)

    def submit(
        self,
        ticket: Ticket,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        matcher: Matcher | None = None,
    ) -> list[SessionHandle]:
        return self.admission.submit(ticket, request, loop, matcher)

    def admit_embedding(self, request: EmbeddingRequest) -> Ticket:
        return self.admission.admit_embedding(request)

    def embed(self, ticket: Ticket, request: EmbeddingRequest, loop: asyncio.AbstractEventLoop) -> list[SessionHandle]:
        return self.admission.embed(ticket, request, loop, self.info.embedding_pooling)

    def tokenize(
        self, ticket: Ticket, prompt: str | None, messages: Sequence[Message], offsets: bool = False
    ) -> tuple[list[int], list[str], list[tuple[int, int]]]:
        return self.admission.tokenize(ticket, prompt, messages, offsets)

    def detokenize(self, ticket: Ticket, token_ids: Sequence[int]) -> tuple[str, int]:
        return self.admission.detokenize(ticket, token_ids)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return self.admission.tokenizer.pieces(token_ids)

    def load_lora(self, name: str, path: str) -> AdapterInfo:
        return self.adapters.load(name, path)

    def unload_lora(self, name: str) -> concurrent.futures.Future[None]:
        return self.adapters.unload(name)

    def keep_lora(self, name: str, waited: float) -> None:
        self.adapters.keep(name, waited)

    def loras(self) -> list[AdapterInfo]:
        return self.adapters.list()

    def _abort(self, session_id: int, reason: FinishReason) -> None:
        self._inbox.put(_Abort(session_id, reason))

    def cancel_all(self) -> None:
        """Ends every session with a final CANCELLED message (the end of a shutdown's grace)."""
        self._inbox.put(_Abort(ALL_SESSIONS, FinishReason.CANCELLED))

    def when_idle(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future on `loop` that resolves once no session is queued or running and no call is
        being tokenized, or the model loop has ended: a drain waits on it, and nothing polls."""
        return self._wait(loop, lambda: self.books.is_idle or not self.is_alive)

    def when_stopped(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future on `loop` that resolves once the model loop has ended (stopped, or dead)."""
        return self._wait(loop, lambda: not self.is_alive)

    def _wait(self, loop: asyncio.AbstractEventLoop, done: Callable[[], bool]) -> asyncio.Future[None]:
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
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # the loop is closed
                pass

    # ---- the model thread -------------------------------------------------------------------

    def _turn(self) -> bool:
        """One step of the core, its events delivered, then the inbox; False once asked to stop."""
        step = self.core.step()
        deliver(step.events)
        return self._drain(block_for=None if step.ran else self.core.idle_wait(time.monotonic()))

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
                self.core.add(msg.session)
            elif isinstance(msg, _Abort) and msg.session_id == ALL_SESSIONS:
                self.core.abort_all(msg.reason)
            elif isinstance(msg, _Abort):
                self.core.abort(msg.session_id, msg.reason)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                deliver(self.core.take_events())  # what adding and aborting ended
                return True


def _resolve(future: asyncio.Future[None]) -> None:
    """A waiter's future resolved, on its loop (unless it was cancelled meanwhile)."""
    if not future.done():
        future.set_result(None)
