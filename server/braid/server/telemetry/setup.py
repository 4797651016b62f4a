"""Turns telemetry on: the OpenTelemetry SDK's providers, Prometheus /metrics and OTLP export.

Called only when --metrics-port, --http-port (which serves /metrics too, as vLLM's port does) or an
OTLP endpoint is set. Metrics go to every reader asked for (Prometheus, OTLP); traces go over OTLP
only, through a BatchSpanProcessor off the event loop.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.exposition import choose_encoder

from braid.server.config import ServerConfig, SettingError
from braid.server.telemetry.metrics import MetricsObserver, observe_engine

if TYPE_CHECKING:
    from braid.server.engine.engine import Engine


@dataclass
class Telemetry:
    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None

    def observe(self, engine: "Engine") -> None:
        """The engine's figures into the instruments, once it is built (after the ports are bound)."""
        observe_engine(engine.client.stats)
        engine.observer = MetricsObserver()

    def shutdown(self) -> None:
        """Sends what is still buffered to the collector (blocking: call it off the event loop)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def start_telemetry(config: ServerConfig, port: int) -> Telemetry:
    """port: the gRPC port being served, which tells this replica apart from others on its host.
    The metrics endpoint is listening when this returns (a port in use fails the start)."""
    resource = Resource.create(
        {
            SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "braid"),
            SERVICE_INSTANCE_ID: f"{socket.gethostname()}:{port}",
        }
    )
    readers: list[MetricReader] = []
    tracer_provider = None
    if config.metrics_port or config.http_port:
        readers.append(PrometheusMetricReader())  # into prometheus_client's registry, which both pages read
    if config.metrics_port:
        try:
            start_http_server(config.metrics_port, addr=(config.metrics_host or config.host).strip("[]"))
        except OSError as exc:
            raise SettingError(
                "metrics_port",
                config.metrics_port,
                f"cannot listen on {config.metrics_host}:{config.metrics_port}: {(exc.strerror or str(exc)).lower()}",
            ) from None
    if config.otlp_endpoint:
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=config.otlp_endpoint)))
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
        trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource)
    metrics.set_meter_provider(meter_provider)
    return Telemetry(meter_provider, tracer_provider)


def prometheus_page(accept: str) -> tuple[bytes, str]:
    """/metrics on the HTTP port: the page --metrics-port serves (the same registry, and
    prometheus_client's own choice of format by the scraper's Accept header), and its content
    type. Blocking: it collects every instrument."""
    encoder, content_type = choose_encoder(accept)
    return encoder(REGISTRY), content_type
