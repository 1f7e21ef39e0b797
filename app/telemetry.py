"""Tracing setup: a tracer provider with the service's resource, OTLP export when configured."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from app.settings import Settings


def build_tracer_provider(
    settings: Settings, extra_processors: list[SpanProcessor] | None = None
) -> TracerProvider:
    """A provider of our own (not the global one), so each app and each test is isolated.

    With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) set, spans are exported
    over OTLP/HTTP in batches; the exporter reads the standard ``OTEL_*`` variables itself.
    """
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.telemetry.service_name})
    )
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    for processor in extra_processors or []:
        provider.add_span_processor(processor)
    return provider


def tracer_from(provider: TracerProvider) -> trace.Tracer:
    return provider.get_tracer("rag-pipeline")
