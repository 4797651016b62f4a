"""What the engine reports as it runs, to whoever listens (telemetry implements it). The engine
defines the interface, so nothing it imports has to know about metrics or traces."""

from __future__ import annotations

from typing import Protocol

from braid.server.engine.types import Finished


class EngineObserver(Protocol):
    def on_pass(self, num_sessions: int, num_tokens: int) -> None:
        """On the model thread, once per forward pass."""

    def on_finish(self, finished: Finished) -> None:
        """On the model thread, once per session."""


class NoObserver:
    """Nobody listening: the default."""

    def on_pass(self, num_sessions: int, num_tokens: int) -> None:
        pass

    def on_finish(self, finished: Finished) -> None:
        pass
