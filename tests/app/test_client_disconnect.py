"""A client that goes away before its request's body has been read whole: a 499 that the log
and metrics record, never a 500 with a traceback (a hostile review on 2026-12-05 made one on
every body route, with a valid key, at no cost: a cut upload, a cut chat body)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tests.conftest import make_settings
from tests.support.servers import free_port

CHAT = b'{"model": "smollm2", "messages": [{"role": "user", "content": "Hello there"}]}'
FORM = (
    b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.md"\r\n\r\n'
    b"# A\n\nSome text that never ends"
)
# Each body route, the content type, and the part of the body sent before the client left.
ROUTES = {
    "chat": ("/v1/chat/completions", b"application/json", CHAT[:30]),
    "chat, whole body sent": ("/v1/chat/completions", b"application/json", CHAT),
    "jobs": ("/v1/jobs", b"application/json", b'{"request": {"model": "smo'),
    "retrieve": ("/v1/retrieve", b"application/json", b'{"query": "tid'),
    "documents": ("/v1/documents", b"application/json", b'{"documents": [{"id": "a'),
    "files": ("/v1/files", b"multipart/form-data; boundary=B", FORM),
}


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(
        redis_server.url, f"http://127.0.0.1:{free_port()}", jobs={"workers": 0}
    )
    async with make_app(settings) as h:
        yield h


async def cut_short(app: Any, key: str, path: str, content_type: bytes, sent: bytes) -> int:
    """Send ``sent`` of a body declared 1 KB longer, then leave (what uvicorn tells the app
    when the client closes its socket); the status the app answered with."""
    headers = [
        (b"host", b"service"),
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", content_type),
        (b"content-length", str(len(sent) + 1024).encode()),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("service", 80),
        "state": {},
    }
    messages = [{"type": "http.request", "body": sent, "more_body": True}]
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await asyncio.wait_for(app(scope, receive, send), 30)
    assert len(statuses) == 1, statuses
    return statuses[0]


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_client_that_leaves_before_its_body_is_read_is_a_499_not_a_500(
    harness, route: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = await harness.key(scopes="chat,retrieve,ingest")
    # A key this process has resolved: chat takes the cache-hit fast path's reading first.
    assert (
        await harness.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    ).status_code == 200
    path, content_type, sent = ROUTES[route]
    with caplog.at_level(logging.INFO):
        status = await cut_short(harness.app, key, path, content_type, sent)
    assert status == 499, route
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    # The service goes on: the same route answers a whole request.
    after = await harness.client.post(
        "/v1/retrieve", json={"query": "tides"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert after.status_code == 200, after.text
