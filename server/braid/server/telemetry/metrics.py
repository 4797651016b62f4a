"""Every braid instrument, declared once, and the few calls that record them.

Names follow the OpenTelemetry conventions (dotted, unit apart); the Prometheus exporter turns
`braid.request.duration` with unit `s` into `braid_request_duration_seconds`, adds `_total` to
counters and drops units in braces. Until setup.py sets a meter provider (no --metrics-port and no
OTLP endpoint: never), every record below is a no-op.
"""

from __future__ import annotations

from typing import Callable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from braid.server.engine.types import EngineStats, Finished, FinishReason

_meter = metrics.get_meter("braid.server")

_LATENCY_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_POWERS_OF_TWO = tuple(2**i for i in range(14))  # 1 .. 8192

FINISH_REASON = "braid.finish_reason"
RPC_METHOD = "rpc.method"
RPC_STATUS_CODE = "rpc.response.status_code"


def _histogram(name: str, unit: str, buckets: tuple[float, ...], description: str) -> metrics.Histogram:
    return _meter.create_histogram(
        name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
    )


QUEUE_DURATION = _histogram(
    "braid.request.queue.duration", "s", _LATENCY_S, "Time from a session's arrival to its first forward pass"
)
TIME_TO_FIRST_TOKEN = _histogram(
    "braid.request.time_to_first_token", "s", _LATENCY_S, "Time from a session's arrival to its first generated token"
)
TIME_PER_OUTPUT_TOKEN = _histogram(
    "braid.request.time_per_output_token", "s", _TOKEN_LATENCY_S, "Decode time per generated token after the first"
)
REQUEST_DURATION = _histogram(
    "braid.request.duration", "s", _LATENCY_S, "Time from a session's arrival to the end of its generation"
)
PASS_SESSIONS = _histogram(
    "braid.forward_pass.sessions", "{session}", _POWERS_OF_TWO, "Sessions in one forward pass (the batch size)"
)
PASS_TOKENS = _histogram(
    "braid.forward_pass.tokens", "{token}", _POWERS_OF_TWO, "Tokens fed to the model in one forward pass"
)
CALL_DURATION = _histogram(
    "rpc.server.call.duration", "s", _LATENCY_S, "Duration of braid's gRPC calls, by method and status code"
)

_ENDED_BY_ITSELF = {
    FinishReason.MAX_TOKENS,
    FinishReason.EOS,
    FinishReason.STOP_SEQUENCE,
    FinishReason.STOP_TOKEN,
    FinishReason.CONSTRAINT,
}


class MetricsObserver:
    """The engine's observer (engine/observer.py): its passes and finished sessions as metrics."""

    @staticmethod
    def on_pass(num_sessions: int, num_tokens: int) -> None:
        """On the model thread, once per forward pass."""
        PASS_SESSIONS.record(num_sessions)
        PASS_TOKENS.record(num_tokens)

    @staticmethod
    def on_finish(finished: Finished) -> None:
        """On the model thread, once per session."""
        points = finished.milestones()
        REQUEST_DURATION.record(points["finish"])
        if "prefill" in points:
            QUEUE_DURATION.record(points["prefill"])
        if "first_token" in points:
            TIME_TO_FIRST_TOKEN.record(points["first_token"])
        # A cancelled session's end is not its last token's time: it says nothing of decoding speed.
        if finished.generated_tokens > 1 and finished.reason in _ENDED_BY_ITSELF:
            decode_s = points["finish"] - points["first_token"]
            TIME_PER_OUTPUT_TOKEN.record(decode_s / (finished.generated_tokens - 1))


def record_call(method: str, status_code: str, seconds: float) -> None:
    CALL_DURATION.record(seconds, {RPC_METHOD: method, RPC_STATUS_CODE: status_code})


def observe_engine(stats: Callable[[], EngineStats]) -> None:
    """Gauges and counters read from the engine's own counts when a reader collects, so they cost
    the model thread nothing."""

    def pages(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        return [
            Observation(stats_now.kv_pages_used, {"braid.kv_page.state": "used"}),
            Observation(stats_now.kv_pages_cached, {"braid.kv_page.state": "cached"}),
        ]

    def cache(name: str) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda options: [Observation(getattr(stats(), name))]

    def sessions(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        return [
            Observation(stats_now.sessions_active, {"braid.session.state": "active"}),
            Observation(stats_now.sessions_queued, {"braid.session.state": "queued"}),
            Observation(stats_now.sessions_paused, {"braid.session.state": "paused"}),
        ]

    def requests(options: CallbackOptions) -> list[Observation]:
        return [Observation(n, {FINISH_REASON: reason.name.lower()}) for reason, n in stats().finished.items()]

    def tokens(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        return [
            Observation(stats_now.prompt_tokens, {"braid.token.type": "prompt"}),
            Observation(stats_now.prompt_tokens_cached, {"braid.token.type": "prompt_cached"}),
            Observation(stats_now.tokens_generated, {"braid.token.type": "generated"}),
        ]

    _meter.create_observable_gauge(
        "braid.sessions",
        [sessions],
        unit="{session}",
        description="Sessions running (holding KV-cache pages), queued, and paused (running, "
        "their clients not reading)",
    )
    _meter.create_observable_counter(
        "braid.requests", [requests], unit="{request}", description="Finished sessions, by finish reason"
    )
    _meter.create_observable_counter(
        "braid.tokens",
        [tokens],
        unit="{token}",
        description="Prompt tokens computed (prompt), prompt tokens found in the prefix "
        "cache (prompt_cached), and tokens generated",
    )

    def hit_ratio(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        looked_up = stats_now.prompt_tokens_cached + stats_now.prompt_tokens
        return [Observation(stats_now.prompt_tokens_cached / looked_up if looked_up else 0.0)]

    _meter.create_observable_gauge(
        "braid.prefix_cache.hit_ratio",
        [hit_ratio],
        unit="1",
        description="Share of prompt tokens found in the prefix cache since start (ServerStatus.prefix_hit_ratio); "
        "per replica, high where a proxy routes calls by their braid-route-key",
    )

    def speculation(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        return [
            Observation(stats_now.speculative_proposed_tokens, {"braid.speculative.outcome": "proposed"}),
            Observation(stats_now.speculative_accepted_tokens, {"braid.speculative.outcome": "accepted"}),
        ]

    def acceptance(options: CallbackOptions) -> list[Observation]:
        stats_now = stats()
        proposed = stats_now.speculative_proposed_tokens
        return [Observation(stats_now.speculative_accepted_tokens / proposed if proposed else 0.0)]

    _meter.create_observable_counter(
        "braid.speculative.tokens",
        [speculation],
        unit="{token}",
        description="Speculative proposals verified (proposed) and confirmed by the model (accepted), --speculative",
    )
    _meter.create_observable_gauge(
        "braid.speculative.acceptance_rate",
        [acceptance],
        unit="1",
        description="Share of speculative proposals the model confirmed since start "
        "(ServerStatus.speculative_acceptance_rate)",
    )
    _meter.create_observable_gauge(
        "braid.kv_cache.usage",
        [pages],
        unit="{page}",
        description="KV-cache pages held by running sessions (used), and held by none but keeping a prefix (cached)",
    )
    _meter.create_observable_gauge(
        "braid.kv_cache.limit", [cache("kv_pages_total")], unit="{page}", description="KV-cache pages in all"
    )
    _meter.create_observable_counter(
        "braid.kv_cache.evictions",
        [cache("kv_evictions")],
        unit="{page}",
        description="Cached KV-cache pages taken back for other use",
    )
    _meter.create_observable_counter(
        "braid.preemptions",
        [cache("preemptions")],
        unit="{session}",
        description="Running sessions whose KV-cache pages were taken back, to be recomputed when readmitted",
    )


class CallMetrics:
    """The front ends' call observer (frontend/observer.py): each call's duration by method and status."""

    @staticmethod
    def on_call(method: str, status_code: str, seconds: float) -> None:
        record_call(method, status_code, seconds)
