"""The one way a span is marked failed, shared by the runner, the clients, the stages, the HTTP
middleware and the job workers."""

from __future__ import annotations

from opentelemetry.semconv.attributes import error_attributes
from opentelemetry.trace import Span, Status, StatusCode


def mark_failed(span: Span, exc: BaseException | None = None, *, kind: str | None = None) -> None:
    """Status ERROR described by ``kind`` (default: the exception's type), ``error.type`` (the
    exception's type, else ``kind``), and the exception, if there is one, as a span event. A
    failure without an exception (a 5xx answered, a webhook refused) passes ``kind`` alone."""
    if exc is None and kind is None:
        raise ValueError("mark_failed needs an exception or a kind")
    if exc is not None:
        span.record_exception(exc)
    name = type(exc).__name__ if exc is not None else kind
    span.set_status(Status(StatusCode.ERROR, kind or name))
    span.set_attribute(error_attributes.ERROR_TYPE, name or "error")
