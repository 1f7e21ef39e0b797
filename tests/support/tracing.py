"""Spans kept in memory: a tracer provider whose every finished span lands in an exporter the
test reads (`exporter.get_finished_spans()`). tests/conftest.py's `tracing` fixture is one."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def memory_tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A fresh provider exporting each span, as it ends, to a fresh in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter
