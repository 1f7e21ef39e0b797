"""The one way a span is marked failed, shared by the runner, the clients and the stages."""

from __future__ import annotations

from opentelemetry.semconv.attributes import error_attributes
from opentelemetry.trace import Span, Status, StatusCode


def mark_failed(span: Span, exc: BaseException, *, kind: str | None = None) -> None:
    """Status ERROR (described by ``kind``, default the exception's type), ``error.type``, and
    the exception as a span event."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, kind or type(exc).__name__))
    span.set_attribute(error_attributes.ERROR_TYPE, type(exc).__name__)
