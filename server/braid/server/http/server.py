"""The HTTP front end's life beside the gRPC server: its port bound with gRPC's (before the model
loads), served by uvicorn on the edge's event loop once the engine is up, and drained with it.

uvicorn runs as a task on the loop grpc.aio runs on (`Server.serve`, not `run`), on the edge's
thread; it installs no signal handlers (braid's process owns SIGTERM and SIGINT, and drains both
servers on the first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Iterator

import uvicorn

from braid.server.config import ServerConfig, SettingError
from braid.server.frontend.observer import CallObserver
from braid.server.http.app import MetricsPage, OpenAIApi
from braid.server.http.connection import bounded

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient

_LOGGER = logging.getLogger(__name__)
_CLOSE_S = 2  # after the drain, seconds (uvicorn's int) for the last responses to go out before connections close


logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start and stop lines: braid logs its own


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # braid's, not uvicorn's
        yield


class HttpFrontEnd:
    """OpenAI's API on --http-port, a front end beside gRPC on its event loop: bound, started and
    drained with it by the composition root (braid/server/app.py)."""

    def __init__(
        self, config: ServerConfig, calls: CallObserver | None = None, metrics: MetricsPage | None = None
    ) -> None:
        """metrics: what serves /metrics (the root passes telemetry's Prometheus page)."""
        self._config = config
        self._calls = calls
        self._metrics = metrics
        self._socket: socket.socket | None = None
        self._api: OpenAIApi | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    def bind(self) -> None:
        """Binds --http-port on --host now: a port in use fails the start at once."""
        host = self._config.host.strip("[]") or None
        try:
            family, kind, _, _, address = socket.getaddrinfo(
                host, self._config.http_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            sock.listen(1024)
        except OSError as exc:
            raise SettingError(
                "http_port",
                self._config.http_port,
                f"cannot listen on {self._config.host}:{self._config.http_port}: {(exc.strerror or str(exc)).lower()}",
            ) from None
        sock.setblocking(False)
        self._socket = sock
        self.port = sock.getsockname()[1]

    async def start(self, engine: EngineClient) -> None:
        """Serves OpenAI's API from the engine, on the running loop."""
        assert self._socket is not None
        self._api = OpenAIApi(engine, self._config, self._calls, self._metrics)
        config = uvicorn.Config(
            self._api.app,
            http=bounded(self._config),  # httptools, with bounds on heads and read times (http/connection.py)
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=_CLOSE_S,
            server_header=False,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # its failure, raised
        _LOGGER.info(
            "OpenAI-compatible HTTP API on http://%s:%d/v1 (%s)",
            self._config.host,
            self.port,
            "API key required" if self._config.api_key else "no API key",
        )

    async def begin_drain(self) -> None:
        """New generation calls get 503 and /health turns 503; calls in flight go on."""
        if self._api is not None:
            self._api.draining = True

    async def stop(self) -> None:
        """Stops listening and ends the connections (after the engine has drained)."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._api is not None:
            self._api.close()
        self._close_socket()

    def hand_over(self) -> None:
        """Nothing to hand over: OpenAI's clients do not resume. A call the drain cancels ends with
        an error all the same, grace or hand-over (http/errors.py), so that its client sees the cut."""

    async def close(self) -> None:
        """A start that failed: closes the port."""
        self._close_socket()

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
