"""The benchmarks' raw load client against a real uvicorn server (the cache bench's floor app
shape): it reads whole responses, keeps connections alive, and stops on a status other than 200."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response

from bench.rawclient import encode_request, measure_raw
from tests.support.servers import free_port

app = FastAPI()
SEEN: list[tuple[str, int]] = []


@app.post("/echo")
async def echo(request: Request) -> Response:
    body = await request.body()
    client = request.client
    SEEN.append((request.headers["x-test"], client.port if client else 0))
    return Response(body * 3, media_type="application/json")


@app.post("/teapot")
async def teapot() -> Response:
    return Response(b'{"error":"no"}', status_code=418, media_type="application/json")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_request_bytes_carry_the_path_the_length_and_the_headers() -> None:
    host, port, message = encode_request("http://127.0.0.1:8123/a/b", b"{}", {"X-Test": "1"})
    assert (host, port) == ("127.0.0.1", 8123)
    head, _, body = message.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /a/b HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 2" in head and b"\r\nX-Test: 1" in head
    assert body == b"{}"


def test_every_request_is_answered_whole_over_kept_alive_connections(base_url: str) -> None:
    SEEN.clear()
    body = b'{"padding":"' + b"x" * 5000 + b'"}'
    stats = asyncio.run(
        measure_raw(f"{base_url}/echo", body, {"x-test": "a"}, requests=90, concurrency=3)
    )
    assert len(SEEN) == 90 + 50  # the measured requests and the warm-up
    assert len({port for _, port in SEEN}) == 3  # one connection per worker, reused
    assert 0 < stats["p50_ms"] <= stats["p99_ms"] and stats["rps"] > 0


def test_a_status_other_than_200_stops_the_run(base_url: str) -> None:
    with pytest.raises(RuntimeError, match="418"):
        asyncio.run(measure_raw(f"{base_url}/teapot", b"{}", {}, requests=5, concurrency=1))
