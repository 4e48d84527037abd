"""Optional OpenTelemetry tracing (--otlp-endpoint): one span per HTTP request, exported over OTLP/gRPC.

The packages are an optional extra (``pip install 'radixserve[otlp]'``). Without them the server
starts anyway and says once, at start, that tracing is off and what to install.

Recent FastAPI (0.165 among them) traces requests natively as soon as any OpenTelemetry provider
is set, this module's included: every request would be traced twice, and FastAPI's wrapper would
take each one past the express lane (server/http/express.py). The app is built with that off
(``native_telemetry_off``): the span per request is this module's.
"""
from __future__ import annotations

import functools
import inspect
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


@functools.cache
def native_telemetry_off() -> dict:
    """``FastAPI(**native_telemetry_off())``: FastAPI's own request telemetry off where it has any."""
    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
