"""The composition root's serving half: `braid serve` (cli.py) hands it the settings and a way to
build the engine, and it wires the rest: the front ends (gRPC, and OpenAI's HTTP API with
--http-port), telemetry (only here is it imported), the signals and the drain.

The front ends' ports are bound before the model loads: a port in use fails the start at once, not
after the load, and the model is loaded only where it can be served. The model loop then runs on
the process's main thread and the front ends on an asyncio loop of their own thread: torch's CPU
kernels ran ~40% slower on a spawned thread than on the main one here (single-stream decode, 13
against 22 tok/s, same process, alternated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from braid.server.config import ServerConfig
from braid.server.frontend.observer import CallObserver
from braid.server.grpc.server import GrpcFrontEnd

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.engine import Engine
    from braid.server.telemetry.setup import Telemetry

_LOGGER = logging.getLogger(__name__)


class FrontEnd(Protocol):
    """A server of the engine on the serving loop (grpc/server.py's gRPC, http/server.py's HTTP):
    bound before the model loads, started once it has, drained with the others."""

    def bind(self) -> None:
        """Binds its port (before the model loads); raises SettingError if it cannot."""

    async def start(self, engine: EngineClient) -> None: ...

    async def begin_drain(self) -> None:
        """New calls are refused from now on; calls in flight go on."""

    def hand_over(self) -> None:
        """The calls the engine is about to cancel end so that their clients resume them elsewhere."""

    async def stop(self) -> None:
        """After the engine has drained: stops serving."""

    async def close(self) -> None:
        """Closes its port (a start that failed)."""


def serve(config: ServerConfig, build_engine: Callable[[], Engine]) -> int:
    """Binds the ports, builds the engine (loads the model), then serves it until SIGTERM/SIGINT
    (exit 0) or until the model loop dies (exit 1). A start that fails raises."""
    calls: CallObserver | None = None
    if telemetry_wanted(config):
        from braid.server.telemetry.metrics import CallMetrics

        calls = CallMetrics()
    grpc_front_end = GrpcFrontEnd(config, calls)
    front_ends: list[FrontEnd] = []
    if config.http_port:
        from braid.server.http.server import HttpFrontEnd
        from braid.server.telemetry.setup import prometheus_page

        front_ends.append(HttpFrontEnd(config, calls, prometheus_page))
    front_ends.append(grpc_front_end)  # started last: its health says SERVING once every port answers
    serving = _Serving(config, front_ends, grpc_front_end)
    signals = _Signals(serving)
    serving.start()
    try:
        serving.bound.result()  # a port in use, a TLS file missing: raised here
        engine = build_engine()
        signals.started(engine)
    except BaseException:
        serving.abandon()
        serving.join()
        raise
    serving.serve(engine)
    try:
        engine.run()  # returns once the front ends have drained and stopped it
    except BaseException:
        _LOGGER.error("the model loop died; shutting down")
    serving.join()
    return serving.exit_code


def telemetry_wanted(config: ServerConfig) -> bool:
    """Whether telemetry is on: metrics to serve (--metrics-port, or --http-port's /metrics, as
    vLLM serves them on its API's port) or to send (OTLP). Off, braid starts no SDK at all."""
    return bool(config.metrics_port or config.http_port or config.otlp_endpoint)


class _Signals:
    """SIGTERM and SIGINT. While the model loads, the first ends the start; once serving, it asks
    for a drain. A second one exits at once, whatever is in flight.

    Handlers run on the main thread, which is the model loop's: they take no lock the loop might
    hold (the serving thread logs the drain, and the sessions in flight)."""

    def __init__(self, serving: _Serving) -> None:
        self._serving = serving
        self._engine: Engine | None = None
        self._received: int | None = None  # the first signal's number
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def started(self, engine: Engine) -> None:
        """The model is loaded. A signal that came during the load ends the start here, had the
        exception it raised been swallowed on the way (torch's tracing catches everything)."""
        self._engine = engine
        if self._received is not None:
            raise SystemExit(128 + self._received)

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._received is not None:
            _LOGGER.warning("%s received again: exiting now, without draining", name)
            os._exit(128 + signum)
        self._received = signum
        if self._engine is None:
            _LOGGER.warning("%s received while starting: exiting", name)
            raise SystemExit(128 + signum)
        self._serving.request_stop(name)


class _Serving(threading.Thread):
    """The front ends' thread and event loop: binds their ports, waits for the engine, serves it,
    drains; and a thread-safe way to ask it to stop."""

    def __init__(self, config: ServerConfig, front_ends: Sequence[FrontEnd], grpc_front_end: GrpcFrontEnd) -> None:
        # A daemon: if the main thread dies while the model loads, the process still ends.
        super().__init__(name="braid-grpc", daemon=True)
        self._config = config
        self._front_ends = front_ends
        self._grpc = grpc_front_end
        self.bound: concurrent.futures.Future[int] = concurrent.futures.Future()  # gRPC's port, or why not
        self._engine: concurrent.futures.Future[Engine | None] = concurrent.futures.Future()  # None: abandoned
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_reason: str | None = None
        self.exit_code = 1

    def serve(self, engine: Engine) -> None:
        self._engine.set_result(engine)

    def abandon(self) -> None:
        """The start failed after the ports were bound: close them and end."""
        if not self._engine.done():
            self._engine.set_result(None)

    def request_stop(self, reason: str) -> None:
        """Safe from a signal handler or any thread; reason: what asked (SIGTERM)."""
        self._stop_reason = reason
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)

    def run(self) -> None:
        try:
            self.exit_code = asyncio.run(self._main())
        except BaseException as exc:
            if self.bound.done():
                _LOGGER.exception("the server failed")
            else:
                self.bound.set_exception(exc)
            self.exit_code = 1
        finally:
            engine = self._engine.result() if self._engine.done() else None
            if engine is not None:
                engine.client.stop()  # the main thread's model loop returns

    async def _main(self) -> int:
        self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_reason is not None:
            self._stop_event.set()
        bound: list[FrontEnd] = []
        telemetry: Telemetry | None = None
        try:
            for front_end in reversed(self._front_ends):  # started last, bound first: gRPC, then HTTP
                front_end.bind()
                bound.append(front_end)
            if telemetry_wanted(self._config):
                from braid.server.telemetry.setup import start_telemetry  # the SDK and exporters: only when asked for

                telemetry = start_telemetry(self._config, self._grpc.port)
        except BaseException:
            await asyncio.gather(*(front_end.close() for front_end in bound))
            raise
        self.bound.set_result(self._grpc.port)
        engine = await asyncio.wrap_future(self._engine)
        try:
            if engine is None:
                await asyncio.gather(*(front_end.close() for front_end in bound))
                return 1
            if telemetry is not None:
                telemetry.observe(engine)
            return await self._serve(engine)
        finally:
            if telemetry is not None:
                await asyncio.to_thread(telemetry.shutdown)

    async def _serve(self, engine: Engine) -> int:
        assert self._stop_event is not None
        stop = self._stop_event
        client = engine.client
        # Everything built so far (torch's and transformers' modules, the model) lives until the exit:
        # out of the collector's sight, a full collection no longer walks its millions of objects while
        # calls wait, and the exit does not spend seconds collecting it (as vLLM and SGLang do).
        gc.freeze()
        for front_end in self._front_ends:
            await front_end.start(client)

        exit_code = 0
        loop = asyncio.get_running_loop()

        async def watch_engine() -> None:
            nonlocal exit_code
            await client.when_stopped(loop)
            if not stop.is_set():
                _LOGGER.error("the model thread has stopped; shutting down")
                exit_code = 1
                stop.set()

        watcher = asyncio.create_task(watch_engine())
        await stop.wait()
        config = self._config
        if exit_code == 0:
            stats = client.stats()
            _LOGGER.info(
                "%s received: draining, %d sessions in flight (%d running, %d queued) get %g s; a second "
                "signal exits at once",
                self._stop_reason or "stop",
                stats.sessions_active + stats.sessions_queued,
                stats.sessions_active,
                stats.sessions_queued,
                config.grace_period,
            )
        await drain(
            client,
            self._front_ends,
            config.grace_period if exit_code == 0 else 0.0,
            handover_grace=config.handover_grace if exit_code == 0 else 0.0,
        )
        watcher.cancel()
        client.stop()
        _LOGGER.info("braid stopped")
        return exit_code


async def drain(
    engine: EngineClient, front_ends: Sequence[FrontEnd], grace_period: float, handover_grace: float = 0.0
) -> None:
    """Every front end refuses new calls at once (health NOT_SERVING and UNAVAILABLE over gRPC, 503
    over HTTP); in-flight streams get the grace period to finish (the engine says when it is idle),
    then the rest end with a final CANCELLED message. With a hand-over grace (--handover-grace), the
    streams still running after it end so that their clients resume them on another replica (over
    gRPC: UNAVAILABLE with the braid-handover trailer, after every token they made; braid's clients
    resume from the tokens they have, resume_token_ids), so a drain takes about that grace,
    whatever the generations' lengths."""
    for front_end in front_ends:
        await front_end.begin_drain()
    engine.stop_accepting()
    wait = min(grace_period, handover_grace) if handover_grace else grace_period
    try:
        await asyncio.wait_for(engine.when_idle(asyncio.get_running_loop()), wait)
    except asyncio.TimeoutError:
        if not engine.is_idle:  # (it may have gone idle just as the grace period ran out)
            stats = engine.stats()
            if handover_grace:
                _LOGGER.info(
                    "hand-over grace over: the calls of %d active and %d queued sessions end UNAVAILABLE, "
                    "to be resumed on another replica",
                    stats.sessions_active,
                    stats.sessions_queued,
                )
                for front_end in front_ends:
                    front_end.hand_over()  # the cancels below end their streams so, with the trailer
            else:
                _LOGGER.info(
                    "grace period over: cancelling %d active and %d queued sessions",
                    stats.sessions_active,
                    stats.sessions_queued,
                )
            engine.cancel_all()
    await asyncio.gather(*(front_end.stop() for front_end in front_ends))
