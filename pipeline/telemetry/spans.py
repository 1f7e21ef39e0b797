"""The one way a span is marked failed, shared by the runner, the clients, the stages, the HTTP
middleware and the job workers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.semconv.attributes import error_attributes, exception_attributes
from opentelemetry.trace import Span, Status, StatusCode

from pipeline.errors import Described


def mark_failed(span: Span, exc: BaseException | None = None, *, kind: str | None = None) -> None:
    """Status ERROR described by ``kind`` (default: the exception's type), ``error.type`` (the
    exception's type, else ``kind``), and the exception, if there is one, as a span event. A
    failure without an exception (a 5xx answered, a webhook refused) passes ``kind`` alone.
    A ``Described`` failure's event has its type and message and no stack (``Described``)."""
    if exc is None and kind is None:
        raise ValueError("mark_failed needs an exception or a kind")
    if isinstance(exc, Described):
        if span.is_recording():
            cls = type(exc)
            span.add_event(
                "exception",
                {
                    exception_attributes.EXCEPTION_TYPE: f"{cls.__module__}.{cls.__qualname__}",
                    exception_attributes.EXCEPTION_MESSAGE: str(exc),
                },
            )
    elif exc is not None:
        span.record_exception(exc)
    name = type(exc).__name__ if exc is not None else kind
    span.set_status(Status(StatusCode.ERROR, kind or name))
    span.set_attribute(error_attributes.ERROR_TYPE, name or "error")


def in_unsampled_trace() -> bool:
    """Whether the current span belongs to a trace that is not sampled: a child span would be
    dropped too (by the parent-based samplers, and by ``always_off`` and ``traceidratio``,
    which decide the same for every span of a trace), so hot paths may skip making one. False
    outside any span: a span started there is a root, and the sampler decides."""
    context = trace.get_current_span().get_span_context()
    return context.is_valid and not context.trace_flags.sampled


@contextmanager
def current_span(tracer: trace.Tracer, name: str, **options: Any) -> Iterator[Span]:
    """``tracer.start_as_current_span(name, **options)``, whose failure is marked by
    ``mark_failed`` (a ``Described`` one without its stack) rather than by the SDK, which
    formats the stack of whatever escapes; a cancellation is not a failure."""
    with tracer.start_as_current_span(
        name, record_exception=False, set_status_on_exception=False, **options
    ) as span:
        try:
            yield span
        except Exception as exc:
            mark_failed(span, exc)
            raise
