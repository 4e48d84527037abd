"""Optional OpenTelemetry tracing (--otlp-endpoint): one span per HTTP request, exported over OTLP/gRPC.

The packages are an optional extra (``pip install 'radixserve[otlp]'``). Without them the server
starts anyway and says once, at start, that tracing is off and what to install.
"""
from __future__ import annotations

import logging

log = logging.getLogger("radixserve.server")

PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-instrumentation-asgi"


def instrument(app, *, endpoint: str | None, service_name: str):
    """``app`` wrapped in OpenTelemetry's ASGI middleware, or ``app`` itself when tracing is off."""
    if not endpoint:
        return app
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning("--otlp-endpoint %s given, but OpenTelemetry tracing is off: %s. Install it with "
                    "pip install 'radixserve[otlp]' (%s)", endpoint, exc, PACKAGES)
        return app
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("OpenTelemetry traces go to %s as service %s", endpoint, service_name)
    return OpenTelemetryMiddleware(app, tracer_provider=provider)
