"""Real OTLP receivers for the tests and the trace picture: spans as the exporter sent them.

``GrpcTraceReceiver`` is an OTLP/gRPC trace service (``opentelemetry-proto``'s
``TraceServiceServicer``) on a grpcio server in this process; it keeps every
``ExportTraceServiceRequest`` with the metadata it came with. ``ReceivedSpan`` is the flat view
of one span (ids in hex, attributes decoded, the resource it came with) that the tests assert
on, made from the gRPC receiver's requests or from the spans oteltap (OTLP/HTTP) hands over.

    python -m tests.support.otlp PORT    # a receiver process that only counts (for bench/)
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.support.servers import free_port


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: any_value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: ids in hex, times in ns, attributes as Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    trace_state: str = ""
    resource: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, span: Span, resource: dict[str, Any] | None = None) -> ReceivedSpan:
        return cls(
            name=span.name,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_id=span.parent_span_id.hex(),
            kind=span.kind,
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
            attributes=attributes(span.attributes),
            status_code=span.status.code,
            trace_state=span.trace_state,
            resource=resource or {},
        )

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def texts(self) -> list[str]:
        """Every attribute value as text (to look for text that must not be there)."""
        return [str(v) for v in self.attributes.values()]


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: GrpcTraceReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.receiver.take(request, dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcTraceReceiver:
    """An OTLP/gRPC trace receiver on a free loopback port (``with`` starts and stops it)."""

    def __init__(self, port: int | None = None, *, keep: bool = True) -> None:
        self.port = port or free_port()
        self.keep = keep  # False: count the spans, keep nothing (a long benchmark)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.span_count = 0
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _Service(self), self._server
        )
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    def take(
        self, request: trace_service_pb2.ExportTraceServiceRequest, metadata: dict[str, str]
    ) -> None:
        with self._lock:
            if self.keep:
                self.requests.append(request)
                self.metadata.append(metadata)
            self.span_count += sum(
                len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
            )

    def __enter__(self) -> GrpcTraceReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            requests = list(self.requests)
        out: list[ReceivedSpan] = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope in resource_spans.scope_spans:
                    out.extend(ReceivedSpan.of(span, resource) for span in scope.spans)
        return out

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0
    ) -> list[ReceivedSpan]:
        """The spans received so far, once ``predicate`` holds for them."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise TimeoutError(f"the receiver did not get the spans in {timeout} s: {names}")
            time.sleep(0.05)


def of_trace(spans: Sequence[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)


def main(argv: list[str]) -> None:
    """Run a receiver that keeps nothing but a count until SIGTERM, then print the count
    (bench's export target)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with GrpcTraceReceiver(int(argv[0]), keep=False) as receiver:
        print(f"receiving OTLP/gRPC on {receiver.endpoint}", flush=True)
        stop.wait()
    print(f"received {receiver.span_count} spans", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
