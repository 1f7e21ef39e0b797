"""ASGI middleware: the root span of every request, and the request-body size limit.

Both are plain ASGI classes (``__init__(app, **options)``, ``async __call__``) so that they
wrap streamed responses too: the root span ends when the last byte of a stream is sent.
"""

from __future__ import annotations

from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.semconv.attributes import http_attributes, url_attributes
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body


class RequestTracing:
    """Opens the server span of each HTTP request and returns its trace id as ``x-trace-id``."""

    def __init__(self, app: ASGIApp, *, tracer: trace.Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = extract(
            {"traceparent": headers["traceparent"]} if "traceparent" in headers else {}
        )
        method, path = scope["method"], scope["path"]
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                http_attributes.HTTP_REQUEST_METHOD: method,
                url_attributes.URL_PATH: path,
            },
        )
        trace_id = format(span.get_span_context().trace_id, "032x")
        token = otel_context.attach(trace.set_span_in_context(span, parent))

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-trace-id", trace_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_trace_id)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            route = scope.get("route")
            if route is not None and getattr(route, "path", None):
                span.set_attribute(http_attributes.HTTP_ROUTE, route.path)
                span.update_name(f"{method} {route.path}")
            otel_context.detach(token)
            span.end()


class BodySizeLimit:
    """Refuses bodies over ``max_bytes`` with a 413, whether or not they declare a length."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read; FastAPI passes HTTPException through
                    # to the error handlers, which render it in OpenAI's shape.
                    raise HTTPException(413, detail=self._message)
            return message

        await self.app(scope, counting_receive, send)

    @property
    def _message(self) -> str:
        return f"Request body is larger than the limit of {self.max_bytes} bytes."

    async def _refuse(self, send: Send) -> None:
        body: dict[str, Any] = error_body(
            self._message,
            "invalid_request_error",
            code="request_too_large",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(body)})
