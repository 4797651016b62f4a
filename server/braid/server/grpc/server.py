"""braid's gRPC server: its service, health checking and reflection behind braid's interceptors, as
one front end of the engine. The composition root (braid/server/app.py) binds it before the model
loads (a port in use fails the start at once, and the model is loaded only where it can be
served), starts it once the engine is built, and drains it; the edge builds the server and
nothing else.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from braid.server.config import ServerConfig, SettingError
from braid.server.grpc import reflection
from braid.server.grpc.auth import ApiKeyInterceptor
from braid.server.grpc.closed_streams import quiet_closed_streams
from braid.server.grpc.errors import ErrorInterceptor
from braid.server.frontend.observer import CallObserver
from braid.server.grpc.request_log import RequestLogInterceptor
from braid.server.grpc.servicer import GenerateServicer
from braid.server.grpc.tracing import TracingInterceptor
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.types import ModelInfo

_LOGGER = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generate"].full_name
_FINAL_MESSAGES_S = 2.0  # after the grace period, time for the final CANCELLED messages to go out


class GrpcFrontEnd:
    """The gRPC server of one engine. `calls`: who records each call's duration and status (the
    root passes telemetry's observer when telemetry is on; with it, each braid call also gets a
    span of its own)."""

    def __init__(self, config: ServerConfig, calls: CallObserver | None = None) -> None:
        self._config = config
        self._calls = calls
        self._server: grpc.aio.Server | None = None
        self._request_log: RequestLogInterceptor | None = None
        self._health: health.aio.HealthServicer | None = None
        self._servicer: GenerateServicer | None = None
        self.port = 0

    def bind(self) -> None:
        """The server with its interceptors, bound to --port, not started: nothing answered yet.
        Raises SettingError if the port cannot be listened on. On the event loop that serves it."""
        config = self._config
        quiet_closed_streams()  # no traceback in the log for a stream its client closed mid-send
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self._calls is not None:
            interceptors.append(TracingInterceptor(self._calls))  # outermost: sees every status
        self._request_log = RequestLogInterceptor() if RequestLogInterceptor.wanted() else None
        if self._request_log is not None:
            interceptors.append(self._request_log)  # outside the API key: refused calls are logged too
        if config.api_key:
            interceptors.append(ApiKeyInterceptor(config.api_key))
        self._server = grpc.aio.server(
            interceptors=[*interceptors, ErrorInterceptor()],
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_concurrent_streams", config.max_concurrent_streams),
                ("grpc.so_reuseport", 0),
                *_connection_options(config),
            ],
        )
        self.port = _listen(self._server, config)

    async def start(self, engine: EngineClient) -> None:
        """Serves the engine: braid's service, health (SERVING once started) and reflection."""
        assert self._server is not None
        self._servicer = GenerateServicer(engine, self._config)
        pb_grpc.add_GenerateServicer_to_server(self._servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self._server)
        if self._request_log is not None:
            self._request_log.mode = engine.info.mode.value
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        _LOGGER.info(
            "braid serving %s on %s:%d (%s)", engine.info.model_name, self._config.host, self.port, running(engine.info)
        )
        _log_settings(self._config)

    async def begin_drain(self) -> None:
        """Health turns NOT_SERVING and new calls get UNAVAILABLE; calls in flight go on."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()

    def hand_over(self) -> None:
        """The streams still running end UNAVAILABLE with the braid-handover trailer once the engine
        cancels them (--handover-grace): braid's clients resume them on another replica."""
        if self._servicer is not None:
            self._servicer.hand_over()

    async def stop(self) -> None:
        """After the engine has drained: the final messages go out, then the server stops."""
        if self._servicer is not None:
            self._servicer.end_subscriptions()
        if self._server is not None:
            await self._server.stop(_FINAL_MESSAGES_S)
        if self._servicer is not None:
            self._servicer.close()

    async def close(self) -> None:
        """A start that failed: closes the port."""
        if self._server is not None:
            await self._server.stop(0)


def running(info: ModelInfo) -> str:
    """What runs, for the start-up line: the device and kernels, the weights as served, what they
    multiply (int8 rows, say, where the dtype alone would say float32), the KV cache and the mode.
    `cpu, avx2 kernels, weights 210 q4_1 + 61 f32 + 1 q8_0 (97 MB), int8 rows, KV cache q8_0
    191 MiB, continuous mode` (the cache's dtype as --kv-cache-dtype auto chose it)."""
    formats = " + ".join(f"{n} {fmt}" for fmt, n in sorted(info.weight_formats.items(), key=lambda kv: -kv[1]))
    kernels = "torch's ops" if info.kernels == "torch" else f"{info.kernels} kernels"
    if info.runner != "braid":
        kernels += f", the {info.runner} path"
    # on a GPU the rows are the compute dtype's (--dtype); on the CPU, --activations says
    rows = f"{info.activations} rows" if info.device == "cpu" else f"{info.dtype} compute"
    return (
        f"{info.device}, {kernels}, weights {formats} ({info.weight_bytes / 1e6:.0f} MB), {rows}, "
        f"KV cache {info.kv_cache_dtype} {info.kv_cache_bytes / 2**20:.0f} MiB, {info.mode.value} mode"
    )


def _connection_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Keepalive, the ping policy and the connection age: gRPC channel arguments from their flags (0 where it
    means gRPC's default or no limit leaves the argument out)."""
    options = [
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(config.keepalive_permit_without_calls)),
        ("grpc.http2.min_ping_interval_without_data_ms", config.min_ping_interval_ms),
        ("grpc.http2.max_pings_without_data", 0),
    ]  # braid's keepalive pings go on over a silent stream
    for name, value in (
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.max_connection_age_ms", config.max_connection_age_ms),
        ("grpc.max_connection_age_grace_ms", config.max_connection_age_grace_ms),
    ):
        if value:
            options.append((name, value))
    return options


def _log_settings(config: ServerConfig) -> None:
    """One line each for what an operator must know is on or off."""
    pages = []
    if config.metrics_port:
        pages.append(f"http://{config.metrics_host}:{config.metrics_port}/metrics (no API key guards it)")
    if config.http_port:
        guard = "the API key guards it" if config.api_key else "no API key"
        pages.append(f"http://{config.host}:{config.http_port}/metrics (beside the HTTP API; {guard})")
    _LOGGER.info("metrics: %s", f"on, {' and '.join(pages)}" if pages else "off")
    _LOGGER.info("OTLP: %s", f"on, traces and metrics to {config.otlp_endpoint}" if config.otlp_endpoint else "off")
    if config.tls_cert is None:
        tls = "off, plaintext"
    elif config.tls_client_ca is None:
        tls = f"on, certificate {config.tls_cert}"
    else:
        tls = f"on, mutual: client certificates signed by {config.tls_client_ca} required"
    _LOGGER.info("TLS: %s", tls)
    _LOGGER.info(
        "API key: %s", "on, every call but health checks needs it" if config.api_key else "off, every caller is served"
    )


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
    assert config.tls_cert is not None and config.tls_key is not None  # ServerConfig has them come together
    cert, key = _pem("tls_cert", config.tls_cert), _pem("tls_key", config.tls_key)
    client_ca = None if config.tls_client_ca is None else _pem("tls_client_ca", config.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


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
        family, kind, _, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return None
