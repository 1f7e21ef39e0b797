"""The HTTP request metrics the middleware records (requests by method, route template and
status, with their latency). The families themselves live in ``pipeline.telemetry.metrics``;
``GET /metrics`` is served by ``app.routes.metrics``.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Histogram

from pipeline.telemetry.metrics import HTTP_DURATION, HTTP_IN_FLIGHT

METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED: Final = "unmatched"  # a path no route has: never the raw path (unbounded labels)


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
