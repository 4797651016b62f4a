"""braid's telemetry: OpenTelemetry metrics, Prometheus /metrics, OTLP export. Only the composition
root (app.py) imports it; it implements the observers the engine (engine/observer.py) and the
front ends (frontend/observer.py) define. The spans themselves are the front ends' (grpc/tracing.py's
gRPC instrumentation, http/observed.py's, and frontend/spans.py, OpenTelemetry's API), recorded once
setup.py sets a tracer provider.

    metrics.py   every instrument, the engine's and the calls' observers that record them
    setup.py     the SDK providers and exporters, started only when asked for
"""
