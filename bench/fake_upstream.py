"""A model server that costs almost nothing: vLLM's streamed chat-completion shape, one token
per chunk, each chunk written on its own after ``--interval-ms``, so that what the service
spends per request and per token can be measured without an engine on the same cores.

    .venv/bin/python -m bench.fake_upstream --port 8101 [--interval-ms 10]

It answers ``POST /v1/chat/completions`` (streamed, ``max_tokens`` tokens, a finish reason,
the usage chunk, ``[DONE]``, then the chunked body's end, as vLLM does), ``GET /v1/models`` and
``GET /health``; anything else is a 404. Hand-written HTTP/1.1 on asyncio streams with
keep-alive: a few microseconds a token, so the service's own costs are what a profile shows.
Only for benchmarks (``bench.stream_cost``): it trusts what it is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial

import orjson

MODEL = "smollm2"
# An answer as the small model writes one: plain words, a number, a citation mark.
ANSWER = (
    "The study found that vitamin D supplementation reduced the risk of fractures by 12 "
    "percent in older adults [1]. However, the effect was smaller in patients who already "
    "had adequate levels, and the trial did not measure long-term outcomes [2]."
)
WORDS = ANSWER.split()


def _chunk(payload: dict[str, object]) -> bytes:
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer_chunks(max_tokens: int, prompt_tokens: int) -> list[bytes]:
    """The chunked-encoding pieces of one streamed answer, in order."""
    head = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = MODEL

    def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    words = itertools.islice(itertools.cycle(WORDS), max_tokens)
    pieces = [_chunk(choice({"role": "assistant", "content": ""}))]
    pieces += [_chunk(choice({"content": (" " if n else "") + w})) for n, w in enumerate(words)]
    pieces.append(_chunk(choice({"content": ""}, "length")))
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + max_tokens,
        "completion_tokens": max_tokens,
    }
    pieces.append(_chunk({**head, "choices": [], "usage": usage}))
    pieces.append(b"e\r\ndata: [DONE]\n\n\r\n")
    pieces.append(b"0\r\n\r\n")
    return pieces


def _response(status: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


async def handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval_s: float
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            length = 0
            for line in header_lines:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            if method == "POST" and path == "/v1/chat/completions":
                request = orjson.loads(body)
                max_tokens = int(request.get("max_tokens") or 16)
                prompt_tokens = len(orjson.dumps(request.get("messages", []))) // 4
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for piece in answer_chunks(max_tokens, prompt_tokens):
                    writer.write(piece)
                    await writer.drain()
                    if interval_s:
                        await asyncio.sleep(interval_s)
            elif method == "GET" and path == "/v1/models":
                listing = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                writer.write(_response("200 OK", orjson.dumps(listing)))
            elif method == "GET" and path == "/health":
                writer.write(_response("200 OK", b""))
            else:
                writer.write(_response("404 Not Found", b'{"error":"not found"}'))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, interval_s: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, interval_s), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def running(interval_ms: float = 10.0) -> Iterator[tuple[str, int]]:
    """The stub as its own process on a free port, answering: its URL and its pid (whose CPU
    time a bench may read); stopped on the way out."""
    from bench.cache_hit import up
    from tests.support.servers import free_port, wait_for

    port = free_port()
    stub = ["--port", str(port), "--interval-ms", str(interval_ms)]
    process = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", *stub])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(partial(up, f"{url}/health"), 30, "the fake model server", step=0.1)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between two chunks")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.interval_ms / 1000.0))


if __name__ == "__main__":
    main()
