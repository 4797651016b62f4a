"""braid's telemetry: OpenTelemetry traces and metrics, Prometheus /metrics, OTLP export.

    metrics.py   every instrument, and the calls that record them
    tracing.py   one span per call (the interceptor) and a session's milestones on it
    setup.py     the SDK providers and exporters, started only when asked for
"""
