"""What every front end holds of the engine: the engine's parts wired once, and the calls other
threads make on them. The model loop (engine/engine.py) makes one and runs its core; the tests'
Harness (tests/unit/engine_fakes.py) makes one and steps its core by hand; the servicer's tests use
a fake with the same calls.

The client reaches the model thread only by posting the typed messages below (`post`: the loop's
inbox, or the Harness's `apply` at once), as mini-sglang's front end talks to its scheduler.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

from braid.server.config import EngineConfig
from braid.server.engine.adapters import Adapters
from braid.server.engine.admission import Admission
from braid.server.engine.books import Books, Ticket
from braid.server.engine.core import EngineCore
from braid.server.engine.grammars import Grammars
from braid.server.engine.handle import SessionHandle
from braid.server.engine.ports import Runner
from braid.server.engine.session import NO_FEATURES, Features, Session
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import EmbeddingRequest, FinishReason, ModelInfo

ALL_SESSIONS = -1


@dataclass
class Add:
    session: Session
    features: Features = NO_FEATURES  # its per-feature state, for the components that own them


@dataclass
class Abort:
    session_id: int  # ALL_SESSIONS: every one
    reason: FinishReason


class Stop:
    pass


class Wake:
    """A paused session's client has read its backlog: look again at who can run."""


ToLoop = Add | Abort | Stop | Wake


def apply(core: EngineCore, message: ToLoop) -> bool:
    """A message applied to the core, on the model thread; False for Stop."""
    if isinstance(message, Stop):
        return False
    if isinstance(message, Add):
        core.add(message.session, message.features)
    elif isinstance(message, Abort) and message.session_id == ALL_SESSIONS:
        core.abort_all(message.reason)
    elif isinstance(message, Abort):
        core.abort(message.session_id, message.reason)
    return True


class EngineClient:
    """The engine's parts (books, adapters, core, admission), and what front ends call on them.

    Each call a front end makes is its part's own method, bound here, so its signature and its
    documentation are written once, where it is implemented: admission's (admit, compile, submit,
    tokenize, detokenize: engine/admission.py), the adapters' (engine/adapters.py) and the books'.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer: Tokenizer,
        info: ModelInfo,
        grammars: Grammars,
        post: Callable[[ToLoop], None],
        draft: Runner | None = None,
    ) -> None:
        """info: what ModelInfo reports, and grammars: the constraint compiler (the composition root
        makes both); post: how a message reaches the model thread; draft: --speculative draft's runner."""
        self.info = info
        self.started_at = time.monotonic()
        self.max_sessions = config.max_sessions  # most sessions running at once, for load reports
        self._post = post
        self._accepting = True
        self._loop_ended = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], Callable[[], bool]]] = []
        self._waiters_lock = threading.Lock()

        self.books = Books(config.max_queued, on_change=self.notify)
        names = info.served_model_names or (info.model_name,)
        self.adapters = Adapters(runner, config.max_loras, config.max_lora_rank, names)
        self.core = EngineCore(config, runner, tokenizer.eos_token_ids, self.books, self.adapters, draft)
        self.kv_events = self.core.kv_events  # the prefix cache's pages stored and evicted, read on the event loop
        self.admission = Admission(
            tokenizer,
            runner.max_seq_len,
            self.books,
            runner.random_state,
            grammars,
            enqueue=lambda s, features: post(Add(s, features)),
            abort=lambda session_id, reason: post(Abort(session_id, reason)),
            wake=lambda: post(Wake()),
            is_open=self._closed_because,
            adapters=self.adapters,
        )

        # the calls, each its part's own method
        self.admit = self.admission.admit  # cheap: on the event loop
        self.compile = self.admission.compile  # blocking: off the event loop, and off the tokenizer threads
        self.submit = self.admission.submit  # blocking: off the event loop
        self.admit_embedding = self.admission.admit_embedding  # cheap: on the event loop
        self.tokenize = self.admission.tokenize
        self.detokenize = self.admission.detokenize
        self.pieces = tokenizer.pieces  # each token's own text (HTTP's logprobs name tokens by text)
        self.stats = self.books.snapshot
        self.load_lora = self.adapters.load
        self.unload_lora = self.adapters.unload  # never blocks: await its future
        self.keep_lora = self.adapters.keep
        self.loras = self.adapters.list

    def embed(self, ticket: Ticket, request: EmbeddingRequest, loop: asyncio.AbstractEventLoop) -> list[SessionHandle]:
        """Admission's embed (engine/admission.py), pooled as the request asks or else as the model
        does (ModelInfo.embedding_pooling). Blocking: off the event loop."""
        return self.admission.embed(ticket, request, loop, self.info.embedding_pooling)

    @property
    def is_idle(self) -> bool:
        """Nothing queued, running or being tokenized."""
        return self.books.is_idle

    def stop_accepting(self) -> None:
        """New calls get UNAVAILABLE from now on (a drain has begun)."""
        self._accepting = False

    def cancel_all(self) -> None:
        """Ends every session with a final CANCELLED message (the end of a shutdown's grace)."""
        self._post(Abort(ALL_SESSIONS, FinishReason.CANCELLED))

    def stop(self) -> None:
        """Ends the model loop."""
        self._accepting = False
        self._post(Stop())

    def loop_ended(self) -> None:
        """The model loop says it has ended: new calls are refused from now on (it then ends its
        sessions, and tells the waiters: notify)."""
        self._accepting = False
        self._loop_ended = True

    def _closed_because(self) -> str | None:
        if self._loop_ended:
            return "the model thread has stopped"
        return None if self._accepting else "the server is shutting down"

    # ---- waiters: futures a drain awaits, resolved when the books change, with no polling ------

    def when_idle(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future on `loop` that resolves once no session is queued or running and no call is
        being tokenized, or the model loop has ended."""
        return self._wait(loop, lambda: self.books.is_idle or self._loop_ended)

    def when_stopped(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future on `loop` that resolves once the model loop has ended (stopped, or dead)."""
        return self._wait(loop, lambda: self._loop_ended)

    def _wait(self, loop: asyncio.AbstractEventLoop, done: Callable[[], bool]) -> asyncio.Future[None]:
        future = loop.create_future()
        with self._waiters_lock:
            self._waiters.append((loop, future, done))
        self.notify()
        return future

    def notify(self) -> None:
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


def _resolve(future: asyncio.Future[None]) -> None:
    """A waiter's future resolved, on its loop (unless it was cancelled meanwhile)."""
    if not future.done():
        future.set_result(None)
