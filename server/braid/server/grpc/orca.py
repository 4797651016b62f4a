"""ORCA load reports: each call's trailers carry `endpoint-load-metrics-bin`, the serialized
xds.data.orca.v3.OrcaLoadReport that gRPC's weighted round robin and Envoy read to weigh replicas.

The message is the standard one (github.com/cncf/xds, xds/data/orca/v3/orca_load_report.proto),
built here from its field numbers rather than imported: the package that ships it (xds-protos)
also installs an old copy of opentelemetry's protos over the real ones, which breaks the OTLP
exporter. The wire format is all a reader sees, and tests/test_orca.py parses these bytes with
xds-protos' own class.
"""

from __future__ import annotations

import collections
import time

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from braid.server.engine.types import EngineStats

KEY = "endpoint-load-metrics-bin"
_WINDOW_S = 10.0  # requests per second over this much of the recent past


def _report_class() -> type[message.Message]:
    fd = descriptor_pb2.FileDescriptorProto(
        name="braid/edge/orca_load_report.proto", package="braid.edge.orca", syntax="proto3"
    )
    msg = fd.message_type.add(name="OrcaLoadReport")
    double, message, repeated = (
        descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
        descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    optional = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    for name, number in (
        ("cpu_utilization", 1),
        ("mem_utilization", 2),
        ("rps_fractional", 6),
        ("eps", 7),
        ("application_utilization", 9),
    ):
        msg.field.add(name=name, number=number, type=double, label=optional)
    for name, number in (("request_cost", 4), ("utilization", 5), ("named_metrics", 8)):
        entry = msg.nested_type.add(name=f"{name.title().replace('_', '')}Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=optional)
        entry.field.add(name="value", number=2, type=double, label=optional)
        msg.field.add(
            name=name,
            number=number,
            type=message,
            label=repeated,
            type_name=f".braid.edge.orca.OrcaLoadReport.{entry.name}",
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("braid.edge.orca.OrcaLoadReport"))


OrcaLoadReport = _report_class()


class LoadReporter:
    """The replica's load as ORCA reports it: KV-cache utilization (pages held by running
    sessions), sessions active and queued, and requests per second."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max(1, max_sessions)
        self._calls: collections.deque[float] = collections.deque()

    def count_call(self) -> None:
        self._calls.append(time.monotonic())

    def report(self, stats: EngineStats) -> tuple[str, bytes]:
        now = time.monotonic()
        while self._calls and self._calls[0] < now - _WINDOW_S:
            self._calls.popleft()
        kv = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        busy = (stats.sessions_active + stats.sessions_queued) / self.max_sessions
        report = OrcaLoadReport(
            application_utilization=max(kv, busy),  # above 1 with a queue: gRPC's WRR weighs it down
            rps_fractional=len(self._calls) / _WINDOW_S,
            utilization={"kv_cache": kv},
            named_metrics={
                "queue_depth": float(stats.sessions_queued),
                "active_sessions": float(stats.sessions_active),
                "kv_cache_utilization": kv,
            },
        )
        return KEY, report.SerializeToString()
