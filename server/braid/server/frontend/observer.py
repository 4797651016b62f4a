"""What the front ends report as they serve, to whoever listens: each call's duration by status.
Telemetry implements it and the composition root wires it in, so no front end imports telemetry
(as the engine defines its own observer, engine/observer.py)."""

from __future__ import annotations

from typing import Protocol


class CallObserver(Protocol):
    def on_call(self, method: str, status_code: str, seconds: float) -> None:
        """A call has ended: its method (gRPC's full name, or "http POST /v1/..."), its status code
        (a gRPC status's name, or an HTTP status) and how long it took."""


class NoCalls:
    """Nobody listening: the default."""

    def on_call(self, method: str, status_code: str, seconds: float) -> None:
        pass
