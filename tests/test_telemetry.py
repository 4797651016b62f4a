"""Telemetry as an operator sees it: a server sending OTLP to a collector (here an in-process OTLP/gRPC
receiver) and serving Prometheus /metrics, called as a client would."""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from braid.server.config import ServerConfig
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import SMALL_WINDOW, Server, free_port, wait_for

PROMPT = "The quick brown fox"
SPAN = "/braid.v1.Generate/Stream"  # as opentelemetry-instrumentation-grpc names it
TIMING_KEYS = ("braid-queue-ms", "braid-time-to-first-token-ms", "braid-total-ms", "braid-tokens-per-second")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver: keeps every span, and the name of every metric, it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.resources: list[dict] = []
        self.metric_names: set[str] = set()
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsReceiver(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                self.resources.append(_attributes(resource_spans.resource.attributes))
                self.spans += [span for scope in resource_spans.scope_spans for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def span(self, trace_id: bytes, name: str) -> trace_pb2.Span | None:
        with self._lock:
            return next((s for s in self.spans if s.trace_id == trace_id and s.name == name), None)


class _MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self._collector = collector

    def Export(self, request, context):
        with self._collector._lock:
            self._collector.metric_names.update(
                m.name for rm in request.resource_metrics for scope in rm.scope_metrics for m in scope.metrics
            )
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _attributes(attributes) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in attributes}


@pytest.fixture(scope="module")
def collector():
    collector = Collector()
    yield collector
    collector.server.stop(0)


@pytest.fixture(scope="module")
def server(tiny_dir, collector, tmp_path_factory):
    metrics_port = free_port()
    log_path = tmp_path_factory.mktemp("telemetry-log") / "server.log"
    # Export quickly, so the test need not wait for the SDK's default 5 s (spans) and 60 s (metrics).
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"}
    server = Server(
        [
            "--model",
            str(tiny_dir),
            "--threads",
            "1",
            "--metrics-port",
            str(metrics_port),
            "--otlp-endpoint",
            f"http://127.0.0.1:{collector.port}",
        ],
        env=env,
        log_path=log_path,
    )
    server.log_path = log_path
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield server
    server.stop()


def traceparent(trace_id: bytes, parent_id: bytes | None = None) -> tuple[str, str]:
    """W3C trace context metadata, as a traced client (or Envoy) sends it."""
    return "traceparent", f"00-{trace_id.hex()}-{(parent_id or os.urandom(8)).hex()}-01"


def stream(target: str, request: pb.GenerateRequest, metadata=()):
    """The messages and trailing metadata of one Stream call over a plain channel."""
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.GenerateStub(channel).Stream(request, metadata=metadata, timeout=60)
        messages = list(call)
        return messages, dict(call.trailing_metadata())


def assert_trailers_carry(t: pb.Timings, trailers: dict) -> None:
    """The final message's timings are in the trailing metadata too (rounded to the microsecond)."""
    assert [float(trailers[k]) for k in TIMING_KEYS] == pytest.approx(
        [t.queue_ms, t.time_to_first_token_ms, t.total_ms, t.tokens_per_second], abs=1e-3
    )


def scrape(server, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    with urllib.request.urlopen(
        urllib.request.Request(server.metrics_url, headers=headers or {}), timeout=10
    ) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    """The sum of a metric's samples that carry these labels (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def test_a_stream_with_a_traceparent_produces_its_span_with_the_session_on_it(server, collector):
    trace_id, parent_id = os.urandom(16), os.urandom(8)
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=8, ignore_eos=True)
    messages, trailers = stream(server.target, request, metadata=(traceparent(trace_id, parent_id),))
    final = messages[-1]

    span = wait_for(lambda: collector.span(trace_id, SPAN))
    assert span.parent_span_id == parent_id
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attributes = _attributes(span.attributes)
    assert attributes["braid.request_id"] == final.request_id
    assert attributes["braid.prompt_tokens"] == final.usage.prompt_tokens > 0
    assert attributes["braid.generated_tokens"] == 8
    assert attributes["braid.finish_reason"] == "max_tokens"
    assert attributes["braid.mode"] == "continuous"
    # opentelemetry-instrumentation-grpc's names for the call; braid's for its status.
    assert (attributes["rpc.service"], attributes["rpc.method"]) == ("braid.v1.Generate", "Stream")
    assert attributes["rpc.response.status_code"] == "OK"
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET

    events = {e.name: e.time_unix_nano for e in span.events}
    assert list(events) == ["queued", "prefill", "first_token", "finish"]
    assert span.start_time_unix_nano <= events["queued"] <= events["prefill"] <= events["first_token"]
    assert events["first_token"] <= events["finish"] <= span.end_time_unix_nano
    # The events are at the engine's own times: the same figures the client got.
    t = final.timings
    assert abs((events["finish"] - events["queued"]) / 1e6 - t.total_ms) < 0.01
    assert abs((events["first_token"] - events["queued"]) / 1e6 - t.time_to_first_token_ms) < 0.01
    assert abs((events["prefill"] - events["queued"]) / 1e6 - t.queue_ms) < 0.01

    # The figures reach the client without any monitoring stack, too: in the trailing metadata.
    assert_trailers_carry(t, trailers)
    assert [r["service.name"] for r in collector.resources][-1] == "braid"


def test_a_refused_call_has_its_status_code_on_its_span_and_in_the_metrics(server, collector):
    trace_id = os.urandom(16)
    before = scrape(server)
    with pytest.raises(grpc.RpcError) as err:
        stream(server.target, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=-1), metadata=(traceparent(trace_id),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    span = wait_for(lambda: collector.span(trace_id, SPAN))
    assert _attributes(span.attributes)["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET  # the client's fault, not the server's
    calls = dict(rpc_method="braid.v1.Generate/Stream", rpc_response_status_code="INVALID_ARGUMENT")
    counted = value(before, "rpc_server_call_duration_seconds_count", **calls)
    # The server records the call's duration as its handler returns, after the status has reached
    # the client (and the span the collector): a scrape at once can come first on a loaded machine
    now = wait_for(
        lambda: (v := value(scrape(server), "rpc_server_call_duration_seconds_count", **calls)) > counted and v
    )
    assert now == counted + 1


def test_a_stream_the_client_closes_ends_its_span_as_cancelled(server, collector):
    trace_id = os.urandom(16)
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.GenerateStub(channel).Stream(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=500, ignore_eos=True), metadata=(traceparent(trace_id),)
        )
        next(call)
        call.cancel()
    span = wait_for(lambda: collector.span(trace_id, SPAN))
    assert _attributes(span.attributes)["rpc.response.status_code"] == "CANCELLED"


def test_a_stream_closed_while_its_send_waits_ends_its_span_as_cancelled(server, collector):
    """grpc cancels the handler where it waits; here that is in grpc's send, so braid's generators
    are left suspended and only closed later (by asyncio, in a task of its own). The span must
    still end with the call's code, and the server's log stay clean: opentelemetry-instrumentation-
    grpc's stream layer then failed to reset its context there and logged it as an ERROR with two
    tracebacks, once for each call a client closed that way."""
    trace_id = os.urandom(16)
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
        call = pb_grpc.GenerateStub(channel).Stream(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=1000, ignore_eos=True), metadata=(traceparent(trace_id),)
        )
        call.initial_metadata()
        with server.client() as client:
            wait_for(lambda: client.server_status(timeout=10).sessions_paused == 1, timeout=60)
        call.cancel()
    span = wait_for(lambda: collector.span(trace_id, SPAN))
    assert _attributes(span.attributes)["rpc.response.status_code"] == "CANCELLED"
    with server.client() as client:
        wait_for(lambda: client.server_status(timeout=10).sessions_active == 0)
    log = server.log_path.read_text()  # the span ends after the library's context is reset, or not
    assert "Failed to detach context" not in log and "Traceback" not in log, log


def test_metrics_move_with_a_stream(server):
    before = scrape(server)
    messages, _ = stream(server.target, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=12, ignore_eos=True))
    prompt_tokens = messages[-1].usage.prompt_tokens
    after = scrape(server)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("braid_tokens_total", braid_token_type="generated") == 12
    assert moved("braid_tokens_total", braid_token_type="prompt") == prompt_tokens
    assert moved("braid_requests_total", braid_finish_reason="max_tokens") == 1
    for histogram in (
        "braid_request_queue_duration_seconds",
        "braid_request_time_to_first_token_seconds",
        "braid_request_time_per_output_token_seconds",
        "braid_request_duration_seconds",
    ):
        assert moved(histogram + "_count") == 1, histogram
        assert moved(histogram + "_bucket", le="+Inf") == 1, histogram
    assert moved("braid_request_duration_seconds_sum") == pytest.approx(messages[-1].timings.total_ms / 1000)
    # One pass for the prompt, one per further token; one session in each.
    assert moved("braid_forward_pass_sessions_count") == 12
    assert moved("braid_forward_pass_sessions_sum") == 12
    assert moved("braid_forward_pass_tokens_sum") == prompt_tokens + 11
    # The call's duration is recorded as the server closes the call, which can be just after the
    # client has read its last message: poll for it.
    calls = dict(rpc_method="braid.v1.Generate/Stream", rpc_response_status_code="OK")
    wait_for(
        lambda: (
            value(scrape(server), "rpc_server_call_duration_seconds_count", **calls)
            - value(before, "rpc_server_call_duration_seconds_count", **calls)
            == 1
        ),
        timeout=5,
    )

    assert value(after, "braid_sessions", braid_session_state="active") == 0
    assert value(after, "braid_sessions", braid_session_state="queued") == 0
    assert value(after, "braid_sessions", braid_session_state="paused") == 0
    # No page is held by a session; pages kept for the prefix cache (state "cached") may remain.
    assert value(after, "braid_kv_cache_usage", braid_kv_page_state="used") == 0
    assert value(after, "braid_kv_cache_limit") > 0


def test_the_http_port_serves_the_same_metrics_behind_the_api_key(tiny_dir):
    """/metrics beside the OpenAI API, as vLLM serves it, with no --metrics-port: the Prometheus
    page with braid's names, moved by an HTTP call; the API key guards it as it guards /v1."""
    http_port = free_port()
    server = Server(
        ["--model", str(tiny_dir), "--threads", "1", "--http-port", str(http_port)], env={"BRAID_API_KEY": "k"}
    )
    base, key = f"http://127.0.0.1:{http_port}", {"Authorization": "Bearer k"}
    try:
        server.metrics_url = base + "/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server.metrics_url, timeout=10)
        assert refused.value.code == 401
        before = scrape(server, key)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0}).encode()
        request = urllib.request.Request(
            base + "/v1/completions", body, {**key, "Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        after = scrape(server, key)
    finally:
        server.stop()
    assert (
        value(after, "braid_tokens_total", braid_token_type="generated")
        - value(before, "braid_tokens_total", braid_token_type="generated")
        == 5
    )
    assert value(after, "braid_kv_cache_limit") > 0
    calls = dict(rpc_method="http POST /v1/completions", rpc_response_status_code="200")
    assert value(after, "rpc_server_call_duration_seconds_count", **calls) == 1


def test_metrics_also_go_to_the_collector(server, collector):
    stream(server.target, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4))
    wanted = {
        "braid.request.duration",
        "braid.request.time_to_first_token",
        "braid.tokens",
        "braid.sessions",
        "braid.forward_pass.sessions",
        "rpc.server.call.duration",
    }
    wait_for(lambda: wanted <= collector.metric_names)


def test_telemetry_is_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    config = ServerConfig()
    assert config.metrics_port == 0 and config.otlp_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert ServerConfig().otlp_endpoint == "http://collector:4317"


def test_with_telemetry_off_a_stream_still_reports_its_timings_to_the_client(servers):
    messages, trailers = stream(servers("continuous").target, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4))
    t = messages[-1].timings
    assert t.total_ms > 0
    assert_trailers_carry(t, trailers)


def _raised_in(module: str, error: BaseException) -> BaseException:
    """error, raised (so with a traceback) in a function of the module named `module`."""
    namespace = {"__name__": module}
    exec("def throw(error):\n    raise error\n", namespace)  # noqa: S102 (a frame of that module)
    try:
        namespace["throw"](error)
    except BaseException as raised:  # noqa: BLE001
        return raised
    raise AssertionError("not raised")


def test_only_a_closed_streams_noise_is_dropped_from_the_two_libraries_logs():
    """The filter behind the clean log above (braid/server/grpc/closed_streams.py) drops the two
    libraries' records of a stream its client closed mid-send, and nothing else they log."""
    from braid.server.grpc import closed_streams

    def kept(logger: str, message: str, error: BaseException) -> bool:
        record = logging.LogRecord(logger, logging.ERROR, __file__, 1, message, None, (type(error), error, None))
        return closed_streams._FILTER.filter(record)

    def detach_failure(exiting: BaseException) -> ValueError:
        error = ValueError("<Token ...> was created in a different Context")
        error.__context__ = exiting
        return error

    layer = "opentelemetry.instrumentation.grpc._aio_server"
    assert not kept(
        "opentelemetry.context", "Failed to detach context", detach_failure(_raised_in(layer, GeneratorExit()))
    )
    assert kept(
        "opentelemetry.context", "Failed to detach context", detach_failure(_raised_in(__name__, GeneratorExit()))
    )
    assert kept("opentelemetry.context", "Failed to detach context", RuntimeError("another failure"))

    class ExecuteBatchError(Exception):  # grpc's, by name (it lives in grpc's Cython module)
        pass

    method = "[/braid.v1.Generate/Stream]"
    assert not kept(
        "grpc._cython.cygrpc", f"ExecuteBatchError raised in core by servicer method {method}", ExecuteBatchError()
    )
    assert kept("grpc._cython.cygrpc", f"Unexpected [ValueError] raised by servicer method {method}", ValueError())
    assert kept(
        "braid.server.grpc.server", "Failed to detach context", detach_failure(_raised_in(layer, GeneratorExit()))
    )
