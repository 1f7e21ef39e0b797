"""Tracing setup: a tracer provider with the service's resource, OTLP export when configured.

Everything about export and sampling comes from the standard OpenTelemetry variables, most of
them read by the SDK itself:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: where to (read by the
  exporter; with neither set, and ``OTEL_TRACES_EXPORTER`` not naming ``otlp``, nothing is
  exported). ``OTEL_TRACES_EXPORTER=none`` switches export off whatever the endpoint.
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc`` or
  ``http/protobuf`` (the specification's default); read here, to choose the exporter.
- ``OTEL_EXPORTER_OTLP_HEADERS`` / ``..._TRACES_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``,
  ``..._INSECURE``, certificates: read by the exporter.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: read by ``TracerProvider`` (default
  ``parentbased_always_on``). Spans that are not sampled are non-recording: no attributes are
  kept, nothing reaches a processor.
- ``OTEL_BSP_*``: the batch processor's queue, batch size and delay, read by the SDK.
- ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` win over the resource built here.
"""

from __future__ import annotations

import os
import uuid
from importlib import metadata
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    SERVICE_VERSION,
    OTELResourceDetector,
    Resource,
)
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from app.settings import Settings

DEPLOYMENT_ENVIRONMENT_NAME: Final = "deployment.environment.name"
PROTOCOLS: Final = ("grpc", "http/protobuf")
# One per process: replicas of the same version and environment stay apart in Jaeger.
INSTANCE_ID: Final = str(uuid.uuid4())


def package_version() -> str:
    try:
        return metadata.version("rag-pipeline")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "0+unknown"


def build_resource(settings: Settings) -> Resource:
    """service.name, service.version, deployment.environment.name and service.instance.id;
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` override them."""
    ours: dict[str, str] = {
        SERVICE_NAME: settings.telemetry.service_name,
        SERVICE_VERSION: package_version(),
        DEPLOYMENT_ENVIRONMENT_NAME: settings.environment,
        SERVICE_INSTANCE_ID: INSTANCE_ID,
    }
    from_env = {k: str(v) for k, v in OTELResourceDetector().detect().attributes.items()}
    service_name = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if service_name:
        from_env[SERVICE_NAME] = service_name
    return Resource.create({**ours, **from_env})


def _env(*names: str) -> str:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return ""


def export_wanted() -> bool:
    exporters = {e.strip().lower() for e in _env("OTEL_TRACES_EXPORTER").split(",") if e.strip()}
    if "none" in exporters or _env("OTEL_SDK_DISABLED").lower() == "true":
        return False
    endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or "otlp" in exporters


def otlp_protocol() -> str:
    protocol = (
        _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or PROTOCOLS[1]
    ).lower()
    if protocol not in PROTOCOLS:
        # Refused at start-up rather than silently exporting nothing.
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use "
            f"{' or '.join(PROTOCOLS)}"
        )
    return protocol


def otlp_exporter() -> SpanExporter:
    """The OTLP span exporter of the configured protocol; it reads its endpoint, headers,
    timeout and TLS settings from the environment itself."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def build_tracer_provider(
    settings: Settings, extra_processors: list[SpanProcessor] | None = None
) -> TracerProvider:
    """A provider of our own (not the global one), so each app and each test is isolated.

    The sampler comes from ``OTEL_TRACES_SAMPLER``; with an OTLP endpoint configured, sampled
    spans are exported in batches (``BatchSpanProcessor``: the request path only enqueues).
    """
    provider = TracerProvider(resource=build_resource(settings))
    if export_wanted():
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter()))
    for processor in extra_processors or []:
        provider.add_span_processor(processor)
    return provider


def tracer_from(provider: TracerProvider) -> trace.Tracer:
    return provider.get_tracer("rag-pipeline", package_version())
