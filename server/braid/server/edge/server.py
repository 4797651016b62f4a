"""Builds and runs the grpc.aio server: braid's service, health checking, reflection, shutdown.

The port is bound before the model loads: a port in use fails the start at once, not after the
load, and the model is loaded only where it can be served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.reflection import SERVICE_NAME as REFLECTION_SERVICE

from braid.server.config import ServerConfig, SettingError
from braid.server.edge.auth import ApiKeyInterceptor
from braid.server.edge import reflection
from braid.server.edge.errors import ErrorInterceptor
from braid.server.edge.request_log import RequestLogInterceptor
from braid.server.edge.servicer import GenerateServicer
from braid.server.edge.telemetry import TelemetryInterceptor
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.engine import Engine  # serve() runs its model loop; the rest sees EngineClient
    from braid.server.telemetry.setup import Telemetry

_LOGGER = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generate"].full_name
_FINAL_MESSAGES_S = 2.0  # after the grace period, time for the final CANCELLED messages to go out


class FrontEnd(Protocol):
    """Another server of the same engine on the gRPC server's event loop (the HTTP API,
    braid/server/http/server.py): bound with it, started with it, drained with it."""

    def bind(self) -> None:
        """Binds its port (before the model loads); raises SettingError if it cannot."""

    async def start(self, engine: EngineClient) -> None: ...

    def begin_drain(self) -> None:
        """New calls are refused from now on; calls in flight go on."""

    async def stop(self) -> None:
        """After the engine has drained: stops serving."""

    def close(self) -> None:
        """Closes its port (a start that failed)."""


def serve(server_config: ServerConfig, build_engine: Callable[[], "Engine"],
          front_ends: Sequence[FrontEnd] = ()) -> int:
    """Binds the ports, builds the engine (loads the model), then serves it until SIGTERM/SIGINT
    (exit 0) or until the model loop dies (exit 1). A start that fails raises. front_ends are
    served beside gRPC, on its loop.

    The model loop runs on the process's main thread and the asyncio gRPC edge on a thread of its
    own: torch's CPU kernels ran ~40% slower on a spawned thread than on the main one here
    (single-stream decode, 13 against 22 tok/s, same process, alternated).
    """
    edge = _Edge(server_config, front_ends)
    signals = _Signals(edge)
    edge.start()
    try:
        edge.bound.result()  # a port in use, a TLS file missing: raised here
        engine = build_engine()
        signals.started(engine)
    except BaseException:
        edge.abandon()
        edge.join()
        raise
    edge.serve(engine)
    try:
        engine.run()  # returns once the edge has drained and stopped it
    except BaseException:
        _LOGGER.error("the model loop died; shutting down")
    edge.join()
    return edge.exit_code


class _Signals:
    """SIGTERM and SIGINT. While the model loads, the first ends the start; once serving, it asks
    the edge to drain. A second one exits at once, whatever is in flight.

    Handlers run on the main thread, which is the model loop's: they take no lock the loop might
    hold (the edge logs the drain, and the sessions in flight, from its own thread)."""

    def __init__(self, edge: _Edge) -> None:
        self._edge = edge
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

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._received is not None:
            _LOGGER.warning("%s received again: exiting now, without draining", name)
            os._exit(128 + signum)
        self._received = signum
        if self._engine is None:
            _LOGGER.warning("%s received while starting: exiting", name)
            raise SystemExit(128 + signum)
        self._edge.request_stop(name)


class _Edge(threading.Thread):
    """The gRPC server's thread: binds the port, waits for the engine, serves it; and a
    thread-safe way to ask it to stop."""

    def __init__(self, config: ServerConfig, front_ends: Sequence[FrontEnd] = ()) -> None:
        # A daemon: if the main thread dies while the model loads, the process still ends.
        super().__init__(name="braid-grpc", daemon=True)
        self._config = config
        self._front_ends = front_ends
        self.bound: concurrent.futures.Future[int] = concurrent.futures.Future()  # the port, or why not
        self._engine: concurrent.futures.Future[Engine | None] = concurrent.futures.Future()  # None: abandoned
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_reason: str | None = None
        self.exit_code = 1

    def serve(self, engine: Engine) -> None:
        self._engine.set_result(engine)

    def abandon(self) -> None:
        """The start failed after the port was bound: close it and end."""
        if not self._engine.done():
            self._engine.set_result(None)

    def run(self) -> None:
        try:
            self.exit_code = asyncio.run(self._main())
        except BaseException as exc:
            if self.bound.done():
                _LOGGER.exception("the gRPC server failed")
            else:
                self.bound.set_exception(exc)
            self.exit_code = 1
        finally:
            engine = self._engine.result() if self._engine.done() else None
            if engine is not None:
                engine.stop()  # the main thread's model loop returns

    async def _main(self) -> int:
        self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_reason is not None:
            self._stop_event.set()
        listening = _bind(self._config)
        try:
            for front_end in self._front_ends:
                front_end.bind()
        except BaseException:
            await listening.close()
            raise
        listening.front_ends = self._front_ends
        self.bound.set_result(listening.port)
        engine = await asyncio.wrap_future(self._engine)
        if engine is None:
            await listening.close()
            return 1
        return await _serve(self._config, listening, engine, self._stop_event, lambda: self._stop_reason)

    def request_stop(self, reason: str) -> None:
        """Safe from a signal handler or any thread; reason: what asked (SIGTERM)."""
        self._stop_reason = reason
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)


@dataclass
class _Listening:
    """A server bound to its port, not started: no service yet, nothing answered."""

    server: grpc.aio.Server
    port: int
    request_log: RequestLogInterceptor | None
    telemetry: Telemetry | None
    front_ends: Sequence[FrontEnd] = ()

    async def close(self) -> None:
        await self.server.stop(0)
        for front_end in self.front_ends:
            front_end.close()
        if self.telemetry is not None:
            await asyncio.to_thread(self.telemetry.shutdown)


def _bind(config: ServerConfig) -> _Listening:
    """The server with its interceptors, bound to --port; the metrics port too when asked for."""
    telemetry_on = bool(config.metrics_port or config.otlp_endpoint)
    interceptors = []
    if telemetry_on:
        interceptors.append(TelemetryInterceptor())  # outermost: sees every status
    request_log = RequestLogInterceptor() if RequestLogInterceptor.wanted() else None
    if request_log is not None:
        interceptors.append(request_log)  # outside the API key: refused calls are logged too
    if config.api_key:
        interceptors.append(ApiKeyInterceptor(config.api_key))
    server = grpc.aio.server(
        interceptors=[*interceptors, ErrorInterceptor()],
        options=[("grpc.max_receive_message_length", config.max_message_bytes),
                 ("grpc.max_concurrent_streams", config.max_concurrent_streams),
                 ("grpc.so_reuseport", 0), *_connection_options(config)])
    port = _listen(server, config)
    telemetry = None
    if telemetry_on:
        from braid.server.telemetry.setup import start_telemetry  # the SDK and exporters: only when asked for

        telemetry = start_telemetry(config, port)
    return _Listening(server, port, request_log, telemetry)


def _connection_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Keepalive, the ping policy and the connection age: gRPC channel arguments from their flags (0 where it
    means gRPC's default or no limit leaves the argument out)."""
    options = [("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
               ("grpc.keepalive_permit_without_calls", int(config.keepalive_permit_without_calls)),
               ("grpc.http2.min_ping_interval_without_data_ms", config.min_ping_interval_ms),
               ("grpc.http2.max_pings_without_data", 0)]  # braid's keepalive pings go on over a silent stream
    for name, value in (("grpc.keepalive_time_ms", config.keepalive_time_ms),
                        ("grpc.max_connection_age_ms", config.max_connection_age_ms),
                        ("grpc.max_connection_age_grace_ms", config.max_connection_age_grace_ms)):
        if value:
            options.append((name, value))
    return options


async def _serve(config: ServerConfig, listening: _Listening, engine: EngineClient, stop: asyncio.Event,
                 stop_reason: Callable[[], str | None]) -> int:
    server, port = listening.server, listening.port
    servicer = GenerateServicer(engine, config)
    pb_grpc.add_GenerateServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, REFLECTION_SERVICE),
        server)
    if listening.telemetry is not None:
        listening.telemetry.observe(engine)
    if listening.request_log is not None:
        listening.request_log.mode = engine.info.mode.value
    # Everything built so far (torch's and transformers' modules, the model) lives until the exit:
    # out of the collector's sight, a full collection no longer walks its millions of objects while
    # calls wait, and the exit does not spend seconds collecting it (as vLLM and SGLang do).
    gc.freeze()
    await server.start()
    for front_end in listening.front_ends:  # before health says SERVING: then every port answers
        await front_end.start(engine)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _LOGGER.info("braid serving %s (%s, %s mode, %s) on %s:%d", engine.info.model_name, engine.info.device,
                 engine.info.mode.value, engine.info.dtype, config.host, port)
    _log_settings(config)

    exit_code = 0
    loop = asyncio.get_running_loop()

    async def watch_engine() -> None:
        nonlocal exit_code
        await engine.when_stopped(loop)
        if not stop.is_set():
            _LOGGER.error("the model thread has stopped; shutting down")
            exit_code = 1
            stop.set()

    watcher = asyncio.create_task(watch_engine())
    await stop.wait()
    if exit_code == 0:
        stats = engine.stats()
        _LOGGER.info("%s received: draining, %d sessions in flight (%d running, %d queued) get %g s; a second "
                     "signal exits at once", stop_reason() or "stop", stats.sessions_active + stats.sessions_queued,
                     stats.sessions_active, stats.sessions_queued, config.grace_period)
    await _drain(server, health_servicer, engine, config.grace_period if exit_code == 0 else 0.0,
                 listening.front_ends,
                 handover_grace=config.handover_grace if exit_code == 0 else 0.0, servicer=servicer)
    watcher.cancel()
    servicer.close()
    engine.stop()
    if listening.telemetry is not None:
        await asyncio.to_thread(listening.telemetry.shutdown)
    _LOGGER.info("braid stopped")
    return exit_code


def _log_settings(config: ServerConfig) -> None:
    """One line each for what an operator must know is on or off."""
    metrics = (f"on, http://{config.metrics_host}:{config.metrics_port}/metrics (no API key guards it)"
               if config.metrics_port else "off")
    _LOGGER.info("metrics: %s", metrics)
    _LOGGER.info("OTLP: %s", f"on, traces and metrics to {config.otlp_endpoint}" if config.otlp_endpoint else "off")
    if config.tls_cert is None:
        tls = "off, plaintext"
    elif config.tls_client_ca is None:
        tls = f"on, certificate {config.tls_cert}"
    else:
        tls = f"on, mutual: client certificates signed by {config.tls_client_ca} required"
    _LOGGER.info("TLS: %s", tls)
    _LOGGER.info("API key: %s", "on, every call but health checks needs it" if config.api_key
                 else "off, every caller is served")


async def _drain(server: grpc.aio.Server, health_servicer, engine: EngineClient, grace_period: float,
                 front_ends: Sequence[FrontEnd] = (), handover_grace: float = 0.0,
                 servicer: GenerateServicer | None = None) -> None:
    """Health turns NOT_SERVING at once and new calls get UNAVAILABLE (503 over HTTP); in-flight
    streams get the grace period to finish (the engine says when it is idle), then the rest end
    with a final CANCELLED message. With a hand-over grace (--handover-grace), the gRPC streams
    still running after it end UNAVAILABLE with the braid-handover trailer, after every token they
    made: braid's clients resume them on another replica from the tokens they have
    (resume_token_ids), so a drain takes about that grace, whatever the generations' lengths."""
    for front_end in front_ends:
        front_end.begin_drain()
    await health_servicer.enter_graceful_shutdown()
    engine.stop_accepting()
    wait = min(grace_period, handover_grace) if handover_grace else grace_period
    try:
        await asyncio.wait_for(engine.when_idle(asyncio.get_running_loop()), wait)
    except asyncio.TimeoutError:
        if not engine.is_idle:  # (it may have gone idle just as the grace period ran out)
            stats = engine.stats()
            if handover_grace:
                _LOGGER.info("hand-over grace over: the calls of %d active and %d queued sessions end UNAVAILABLE, "
                             "to be resumed on another replica", stats.sessions_active, stats.sessions_queued)
                if servicer is not None:
                    servicer.hand_over()  # the cancels below end their streams UNAVAILABLE, with the trailer
            else:
                _LOGGER.info("grace period over: cancelling %d active and %d queued sessions",
                             stats.sessions_active, stats.sessions_queued)
            engine.cancel_all()
    await asyncio.gather(server.stop(_FINAL_MESSAGES_S), *(front_end.stop() for front_end in front_ends))


def _listen(server: grpc.aio.Server, config: ServerConfig) -> int:
    address = f"{config.host}:{config.port}"
    # Tried plainly first: grpc's own failure is a line of C-core log on stderr, and no reason.
    why_not = _bind_failure(config.host, config.port)
    if why_not is None:
        try:
            if config.tls_cert is None:
                return server.add_insecure_port(address)
            return server.add_secure_port(address, _tls_credentials(config))
        except RuntimeError:  # "Failed to bind"
            why_not = "grpc could not bind it"
    raise SettingError("port", config.port, f"cannot listen on {address}: {why_not}")


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    cert, key = _pem("tls_cert", config.tls_cert), _pem("tls_key", config.tls_key)
    client_ca = None if config.tls_client_ca is None else _pem("tls_client_ca", config.tls_client_ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _pem(name: str, path: Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SettingError(name, path, (exc.strerror or str(exc)).lower()) from None
    if b"-----BEGIN" not in data:
        raise SettingError(name, path, "not a PEM file")
    return data


def _bind_failure(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on, or None: bound once plainly, with the SO_REUSEADDR
    grpc sets (a port whose old connections linger in TIME_WAIT is free)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return None
