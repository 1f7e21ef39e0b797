"""``GET /metrics`` in Prometheus's text format.

The families themselves live in ``pipeline.telemetry.metrics`` (the pipeline records most of
them); this module serves the default registry, which also holds prometheus-client's process
collectors (CPU, memory, open files, garbage collection).

``/metrics`` is on the API's port, so with ``RAG_TELEMETRY__METRICS_TOKEN`` set it answers only a
scraper that sends that token as a bearer token (Prometheus' ``authorization`` config); anyone
else gets the 401 of a missing API key. Production refuses to start without a token.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.responses import Response

from app.http.auth import bearer_token
from pipeline.errors import AuthenticationFailed

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    # A plain function: FastAPI runs it in its thread pool, off the event loop.
    token = request.app.state.settings.telemetry.metrics_token
    if token is not None and not _same(bearer_token(request), token.get_secret_value()):
        raise AuthenticationFailed("Invalid or missing metrics token.")
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _same(given: str | None, expected: str) -> bool:
    # Constant time, so the answer's timing does not spell the token out.
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
