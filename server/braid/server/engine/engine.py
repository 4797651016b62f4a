"""The engine's loop: one model thread that runs the core (engine/core.py) and talks to the rest.

    while running:
        step = core.step()                  # one forward pass, its events
        deliver(step.events)                # to the sessions' event loops
        apply the inbox                     # sessions added and aborted, by other threads

Other threads talk to it only through its client (engine/client.py): admission, the books
(engine/books.py), and the typed messages the client posts to the inbox. What it does is reported to
an observer (engine/observer.py), which telemetry implements.
"""

from __future__ import annotations

import logging
import queue
import time

from braid.server import resources
from braid.server.config import EngineConfig
from braid.server.engine.client import EngineClient, ToLoop, apply
from braid.server.engine.grammars import Grammars
from braid.server.engine.observer import EngineObserver
from braid.server.engine.output import deliver
from braid.server.engine.ports import Runner
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import FinishReason, ModelInfo

_LOGGER = logging.getLogger(__name__)


# Once the loop has run no pass for this long, the heap pages that the passes freed go back to the
# system (resources.release_freed_heap), once: a prompt chunk's activations, freed, stayed resident in
# glibc's heaps (25-58 MiB at the 1B shape after 16 prompts at once, one thread, which a malloc_trim
# gave back; benchmarks/memory_steps.py). Not between passes: the next would fault them back in.
RELEASE_AFTER_IDLE_S = 1.0


class Engine:
    """The model loop around an EngineCore; `client` is what the front ends call."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer: Tokenizer,
        info: ModelInfo,
        grammars: Grammars,
        draft: Runner | None = None,
    ) -> None:
        """EngineClient's arguments (engine/client.py); its messages come to this loop's inbox."""
        self._inbox: queue.SimpleQueue[ToLoop] = queue.SimpleQueue()
        self.client = EngineClient(config, runner, tokenizer, info, grammars, self._inbox.put, draft)
        self.core = self.client.core
        self._last_pass: float | None = None  # when the last pass ran, until the heap is released after it

    @property
    def observer(self) -> EngineObserver:
        return self.core.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self.core.observer = observer

    def run(self) -> None:
        """Runs the model loop on the calling thread until the client's stop(); `braid serve` uses
        the main thread, where torch's CPU kernels run fastest."""
        try:
            while self._turn():
                pass
        except BaseException as exc:  # the engine is dead: say so, loudly, and end every session
            _LOGGER.exception("the model thread died")
            self.core.abort_all(FinishReason.ERROR, f"the model thread died: {exc}")
            deliver(self.core.take_events())
            raise
        finally:
            self.client.loop_ended()
            self.core.abort_all(FinishReason.CANCELLED)
            deliver(self.core.take_events())
            self.client.notify()

    def _turn(self) -> bool:
        """One step of the core, its events delivered, then the inbox; False once asked to stop."""
        step = self.core.step()
        deliver(step.events)
        now = time.monotonic()
        if step.ran:
            self._last_pass = now
            return self._drain(block_for=None)
        if self._last_pass is not None and now - self._last_pass >= RELEASE_AFTER_IDLE_S:
            self._last_pass = None
            resources.release_freed_heap()
        return self._drain(block_for=self.core.idle_wait(now))

    def _drain(self, block_for: float | None) -> bool:
        """Applies every inbox message; waits up to block_for seconds for the first one."""
        try:
            message = self._inbox.get(timeout=block_for) if block_for else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while apply(self.core, message):
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                deliver(self.core.take_events())  # what adding and aborting ended
                return True
        return False
