"""``GET /metrics`` in Prometheus's text format, and the HTTP request metrics of the middleware.

The families themselves live in ``pipeline.metrics`` (the pipeline records most of them); this
module serves the default registry, which also holds prometheus-client's process collectors
(CPU, memory, open files, garbage collection).
"""

from __future__ import annotations

from typing import Final

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Histogram, generate_latest
from starlette.responses import Response

from pipeline.metrics import HTTP_DURATION, HTTP_IN_FLIGHT

router = APIRouter(tags=["metrics"])

METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED: Final = "unmatched"  # a path no route has: never the raw path (unbounded labels)


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    # A plain function: FastAPI runs it in its thread pool, off the event loop.
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


class HttpMetrics:
    """Requests by method, route template and status, with their latency."""

    def __init__(self) -> None:
        # Children bound once per label set: a label lookup takes a lock and a dict access.
        self._children: dict[tuple[str, str, int], Histogram] = {}

    def started(self) -> None:
        HTTP_IN_FLIGHT.inc()

    def finished(self, method: str, route: str | None, status: int, seconds: float) -> None:
        HTTP_IN_FLIGHT.dec()
        key = (method if method in METHODS else "other", route or UNMATCHED, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HTTP_DURATION.labels(key[0], key[1], str(status))
        child.observe(seconds)
