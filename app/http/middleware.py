"""ASGI middleware: the root span, metrics and log line of every request, and the body limit.

Both are plain ASGI classes (``__init__(app, **options)``, ``async __call__``) so that they
wrap streamed responses too: the root span ends, and the request's duration is taken, when the
last byte of a stream is sent.
"""

from __future__ import annotations

import time
from typing import Final

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.semconv.attributes import http_attributes, url_attributes
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.logs import RequestFacts, RequestLog, handed_context
from app.metrics import HttpMetrics
from pipeline.errors import PayloadTooLarge
from pipeline.looptime import Serving
from pipeline.telemetry.metrics import NOT_ROUTED
from pipeline.telemetry.spans import mark_failed

# Trace context headers (W3C Trace Context and Baggage): the caller's trace, which a request
# links to, or continues with ``follow_callers``.
PROPAGATED: Final = frozenset({b"traceparent", b"tracestate", b"baggage"})
_TRACE_CONTEXT: Final = TraceContextTextMapPropagator()
UNTRACED: Final = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestTracing:
    """The root span of each HTTP request, its metrics and its log line.

    Each request is a trace of its own, whose id goes back as ``x-trace-id``; a caller's trace
    context (``traceparent``) is a link on the root span. Only with ``follow_callers`` (callers
    the operator trusts, a gateway of theirs) does the span continue the caller's trace, with
    its ``tracestate``, ``baggage`` and sampling decision: otherwise a caller who learned another
    tenant's trace id could put its requests into that tenant's trace, and any caller could turn
    tracing off for its own requests (``sampled`` 0) or on for all of them. Probes and scrapes
    (``untraced``) get no span, so a healthcheck every few seconds does not fill Jaeger; they
    are still counted and logged (at debug level).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracer: trace.Tracer,
        metrics: HttpMetrics | None = None,
        request_log: RequestLog | None = None,
        untraced: frozenset[str] = UNTRACED,
        follow_callers: bool = False,
    ) -> None:
        self.app = app
        self.follow_callers = follow_callers
        self.tracer = tracer
        self.metrics = metrics
        self.request_log = request_log
        self.untraced = untraced

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        facts = RequestFacts(scope["method"], scope["path"])
        span, token = None, None
        if facts.path not in self.untraced:
            parent, links = self._parent(scope)
            span = self._start_span(facts, parent, links)
            token = otel_context.attach(trace.set_span_in_context(span, parent))
        trace_id = format(span.get_span_context().trace_id, "032x").encode() if span else b""
        if self.metrics is not None:
            self.metrics.started()

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                facts.status = message["status"]
                if span is not None:
                    span.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, facts.status)
                    if facts.status >= 500:
                        mark_failed(span, kind=str(facts.status))
                    added = [(b"x-trace-id", trace_id)]
                    if facts.status >= 400:
                        # What OpenAI's SDKs show of an error (an answer has its own: its id).
                        added.append((b"x-request-id", b"req_" + trace_id))
                    message["headers"] = [*message.get("headers", []), *added]
            await send(message)

        try:
            with Serving():  # the loop's lag clock ticks finely while a request is served
                await self.app(scope, receive, send_with_trace_id)
        except BaseException as exc:
            facts.status = facts.status or 500  # the server's error handler answers outside us
            if span is not None:
                mark_failed(span, exc)
            raise
        finally:
            route = scope.get("route")
            facts.route = getattr(route, "path", None) or None
            facts.ctx = handed_context(scope)
            self._finish(facts, span, _route_label(scope, facts.route))
            if token is not None:
                otel_context.detach(token)

    def _parent(self, scope: Scope) -> tuple[otel_context.Context, list[trace.Link]]:
        """The context our span starts in (the caller's when followed, else a fresh one: our
        span is then a root) and its links (the caller's span, when not followed)."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in PROPAGATED
        }
        if self.follow_callers:
            return (extract(carrier) if carrier else otel_context.Context()), []
        if "traceparent" not in carrier:
            return otel_context.Context(), []
        # The traceparent alone: the caller's tracestate and baggage are not ours to keep (nor
        # to log, as the baggage propagator does with a header it finds too long).
        caller = _TRACE_CONTEXT.extract({"traceparent": carrier["traceparent"]})
        called = trace.get_current_span(caller).get_span_context()
        if not called.is_valid:
            return otel_context.Context(), []
        link = trace.SpanContext(
            called.trace_id, called.span_id, is_remote=True, trace_flags=called.trace_flags
        )
        return otel_context.Context(), [trace.Link(link)]

    def _start_span(
        self, facts: RequestFacts, parent: otel_context.Context, links: list[trace.Link]
    ) -> trace.Span:
        return self.tracer.start_span(
            f"{facts.method} {facts.path}",
            context=parent,
            links=links,
            kind=SpanKind.SERVER,
            attributes={
                http_attributes.HTTP_REQUEST_METHOD: facts.method,
                url_attributes.URL_PATH: facts.path,
            },
        )

    def _finish(
        self, facts: RequestFacts, span: trace.Span | None, route_label: str | None
    ) -> None:
        """Metrics, the log line (while the span is current), then the span's end."""
        duration = time.perf_counter() - facts.started
        if self.metrics is not None:
            self.metrics.finished(facts.method, route_label, facts.status, duration)
        ids = span.get_span_context() if span is not None else None
        if self.request_log is not None:
            self.request_log.write(
                facts, duration, ids.trace_id if ids else 0, ids.span_id if ids else 0
            )
        if span is not None:
            if facts.route is not None:
                span.set_attribute(http_attributes.HTTP_ROUTE, facts.route)
                span.update_name(f"{facts.method} {facts.route}")
            span.end()


def _route_label(scope: Scope, route: str | None) -> str | None:
    """The metrics' ``route``: the template of the route that ran; ``none`` when a middleware
    answered before the router ran (the key check's 401, a declared body over the limit), so
    no route did; None (``unmatched``) when the router found no route for the path."""
    if route is not None:
        return route
    return None if "router" in scope else NOT_ROUTED


class BodySizeLimit:
    """Refuses bodies over ``max_bytes`` with a 413, whether or not they declare a length;
    ``paths`` names the few routes with a limit of their own (file uploads)."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, paths: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.max_bytes)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(send, limit)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read: the app's error handler renders it.
                    raise self._too_large(limit)
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self, limit: int) -> PayloadTooLarge:
        """The one 413 of both branches: a declared length over the limit, or a body that
        grows past it as it arrives."""
        return PayloadTooLarge(
            f"Request body is larger than the limit of {limit} bytes.",
            code="request_too_large",
        )

    async def _refuse(self, send: Send, limit: int) -> None:
        body = self._too_large(limit).to_dict()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(body)})
