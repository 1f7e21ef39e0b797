"""A load client that costs less than the servers it measures: raw HTTP/1.1 over keep-alive
sockets, the request bytes built once, the response read by its Content-Length.

A general HTTP client (httpx) spends a few hundred microseconds of Python per request building
and parsing messages; on two shared cores that time is taken from the server being measured
and added to both sides of every ratio. This client sends pre-encoded bytes and reads the
status line, the headers up to the blank line and exactly Content-Length bytes of body. It
speaks only what the benchmarked servers answer: HTTP/1.1 with a Content-Length (no chunked
responses), one request in flight per connection.

    stats = await measure_raw("http://127.0.0.1:8000/v1/chat/completions", body, headers,
                              requests=2000, concurrency=32)
"""

from __future__ import annotations

import asyncio
import statistics
import time
from urllib.parse import urlsplit


def encode_request(url: str, body: bytes, headers: dict[str, str]) -> tuple[str, int, bytes]:
    """(host, port, the whole request as bytes): a POST of `body` as JSON, kept alive."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lines = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response: (status, body). Fails on a response without Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = -1
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
            break
    if length < 0:
        raise RuntimeError(f"no Content-Length in {head[:200]!r}")
    return status, await reader.readexactly(length)


async def measure_raw(
    url: str,
    body: bytes,
    headers: dict[str, str],
    requests: int,
    concurrency: int,
    warmup: int = 50,
) -> dict[str, float]:
    """p50 and p99 latency (ms) and requests/s of `requests` POSTs over `concurrency`
    keep-alive connections; any status but 200 stops the run."""
    host, port, message = encode_request(url, body, headers)
    connections = [await asyncio.open_connection(host, port) for _ in range(concurrency)]
    latencies: list[float] = []

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
        started = time.perf_counter()
        writer.write(message)
        status, content = await read_response(reader)
        elapsed = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"{url}: {status} {content[:200]!r}")
        return elapsed

    try:
        for i in range(min(warmup, requests)):
            await one(*connections[i % concurrency])
        queue = iter(range(requests))

        async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in queue:
                latencies.append(await one(reader, writer))

        started = time.perf_counter()
        await asyncio.gather(*(worker(r, w) for r, w in connections))
        wall = time.perf_counter() - started
    finally:
        for _, writer in connections:
            writer.close()
    return summarise(latencies, wall)


def summarise(latencies: list[float], wall: float) -> dict[str, float]:
    """p50 and p99 (ms) of request latencies in seconds, and requests/s over `wall` seconds."""
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000,
        "rps": len(ordered) / wall,
    }
