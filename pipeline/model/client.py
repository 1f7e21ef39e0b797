"""The client of vLLM's OpenAI-compatible server: pooled connections, timeouts, error mapping.

httpx errors and upstream error responses are converted here into the pipeline's errors:
cannot connect -> 503, no answer in time -> 504, the upstream refusing the request -> 400/404
with its message, the upstream failing or dropping the connection mid-answer -> 502. What the
caller did not cause is not reported as the caller's 400: the model server refusing this
service's own credentials (401/403) is a 502, its rate limit (429) a 429 with its
``Retry-After``. A stream is whole only with a finish reason and ``[DONE]``: one that ends
without them, or sends a line that is not a JSON object, is the upstream failing (502), so a
cut answer is never taken for a complete one (and never cached).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final

import httpx
import orjson

from pipeline.errors import (
    ContextTooLong,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PipelineError,
    ServiceUnavailable,
    UpstreamError,
    retry_after,
)
from pipeline.model import transport as network

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0
# After ``[DONE]``: how long, and how many lines, the end of a stream's body is waited for.
END_OF_BODY_S: Final = 0.05
END_OF_BODY_LINES: Final = 4
END_OF_BODY_MARGIN_S: Final = 0.01
KEEPALIVE_EXPIRY_S: Final = 2.0
# Connection pools per client. httpcore's pool walks all of its connections on every request
# and at the end of every response (and checks each idle one against all the others, with a
# readability poll of its socket), so one pool serving N streams at once costs O(N) to O(N^2)
# per call: 3.6-4.4 ms of CPU per 8-token call at 32 concurrent streams against 1.4-1.8 ms
# with the calls spread over 4-16 pools, 5.2 against 1.6-1.9 ms at 128 (BENCHMARKS.md, issue
# 18). The pools share ``max_connections`` between them, and the client, not a pool, makes a
# call over that limit wait (for the first connection freed in any pool). A call takes the pool
# with the fewest calls in flight, the first of those, so at low concurrency every call reuses
# the first pool's connection. The readiness probe has a connection of its own.
POOLS: Final = 8
# The usage on every chunk (vLLM's continuous usage stats), so that a stream cut short knows
# what it spent (``pipeline.model.spend``); the last chunk has the whole answer's. A server
# that refuses the field (a strict OpenAI-compatible one) gets only the final usage.
STREAM_OPTIONS: Final = {"include_usage": True, "continuous_usage_stats": True}
FINAL_USAGE: Final = {"include_usage": True}
RUNNING_USAGE_FIELD: Final = b"continuous_usage_stats"
# The longest line of a streamed answer read (a chunk is a few hundred bytes; a tool call's
# arguments or logprobs make it longer, never this long).
MAX_LINE_BYTES: Final = 16 * 1024 * 1024


class UpstreamRateLimited(PipelineError):
    """429: the model server limits this service's requests; its ``Retry-After`` is passed on."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"The model server is limiting requests; retry later: {message}",
            code="upstream_rate_limited",
            headers=retry_after(retry_after_s),
        )


def _parse(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:500]


def _details(data: Any) -> tuple[str, str | None]:
    """The message of a model server's error body (parsed), and the request field it names,
    if any (a short name)."""
    if not isinstance(data, dict):
        return str(data)[:2000], None
    error = data.get("error", data)
    if not isinstance(error, dict):
        return str(data.get("message") or data.get("detail") or error)[:2000], None
    param = error.get("param")
    message = str(error.get("message") or error.get("detail") or error)[:2000]
    return message, param if isinstance(param, str) and 0 < len(param) <= 64 else None


def upstream_error(status: int, body: bytes, headers: httpx.Headers | None = None) -> PipelineError:
    return refusal(status, _parse(body), headers)


def _retry_after(headers: httpx.Headers | None) -> float:
    try:
        seconds = float(headers.get("retry-after", "1") if headers is not None else 1)
    except ValueError:  # an HTTP date, or nonsense: wait the least
        seconds = 1.0
    return min(max(seconds, 1.0), MAX_RETRY_AFTER_S)


def refusal(status: int, data: Any, headers: httpx.Headers | None = None) -> PipelineError:
    """Our error for the model server's refusal: our shape and a code, its words only as the
    reason (what reaches it was validated here first, so this is rare)."""
    message, param = _details(data)
    if status in (401, 403):
        # This service's credentials (RAG_LLM__API_KEY), not the caller's: a bad gateway.
        return UpstreamError(
            f"The model server refused this service's credentials ({status}): {message}",
            code="upstream_unauthorized" if status == 401 else "upstream_forbidden",
        )
    if status == 429:
        return UpstreamRateLimited(message, retry_after_s=_retry_after(headers))
    if status == 404:
        return NotFound(
            f"The model server does not serve this model: {message}",
            param="model",
            code="model_not_found",
        )
    if status in (400, 422):
        if "context length" in message.lower() or "maximum context" in message.lower():
            return ContextTooLong(f"The request does not fit the model's context: {message}")
        return InvalidRequest(
            f"The model server refused the request: {message}",
            param=param,
            code="upstream_rejected",
        )
    if 400 <= status < 500:
        return InvalidRequest(
            f"The model server refused the request ({status}): {message}",
            code="upstream_rejected",
        )
    return UpstreamError(f"the model server failed ({status}): {message}", code="upstream_failed")


def _stream_error(chunk: dict[str, Any], started: bool) -> PipelineError:
    """An error event in the stream. Before any chunk, a refusal (vLLM streams some request
    checks, such as logit_bias against the vocabulary, as a first event with a 4xx code) is
    the same 400 as one in the status line; anything else, or after the answer began, is the
    model server failing (502)."""
    error = chunk["error"]
    code = error.get("code") if isinstance(error, dict) else None
    if not started and isinstance(code, int) and 400 <= code < 500:
        return refusal(code, chunk)
    return UpstreamError(f"the model server failed mid-stream: {error}", code="upstream_failed")


async def lines(body: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """A body's lines, as bytes, without their ends (LF, CRLF or a lone CR, as SSE allows;
    a CRLF split between two pieces gives one more, empty, line). httpx's ``aiter_lines``
    decodes the text and splits it in three generators a piece; here it is split once. A line
    longer than ``MAX_LINE_BYTES`` is the model server failing (``upstream_malformed``)."""
    pending: list[bytes] = []  # the start of a line whose end has not come
    size = 0
    async for data in body:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in data:
            pending.append(data)
            size += len(data)
            if size > MAX_LINE_BYTES:
                raise UpstreamError(
                    f"The model server sent a stream line over {MAX_LINE_BYTES} bytes.",
                    code="upstream_malformed",
                )
            continue
        if pending:  # each byte joined once: a long line in many pieces stays linear
            data = b"".join((*pending, data))
        *whole, rest = data.split(b"\n")
        for line in whole:
            yield line
        pending, size = ([rest], len(rest)) if rest else ([], 0)
    if pending:
        yield b"".join(pending)


def _chunk(data: bytes) -> dict[str, Any]:
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:  # not JSON, or not UTF-8: read as httpx's text would be
        try:
            chunk = orjson.loads(data.decode("utf-8", "replace"))
        except orjson.JSONDecodeError:
            chunk = None
    if not isinstance(chunk, dict):
        line = data[:200].decode(errors="replace")
        raise UpstreamError(
            f"The model server sent a malformed stream line: {line!r}",
            code="upstream_malformed",
        )
    return chunk


def _finishes(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("finish_reason") for choice in choices
    )


async def _read_to_end(body: AsyncIterator[bytes], deadline: float | None) -> None:
    """Read what follows ``[DONE]``: the body's end (the chunked encoding's last chunk), so
    that the connection goes back to the pool. Left unread, httpx closes it, and every answer
    costs the model server and this process a new TCP connection. The answer is complete
    already, so this never fails it: a server that sends more, or does not end the body
    within ``END_OF_BODY_S`` (or before the caller's ``deadline``, less a margin, so that the
    caller's own bound never expires in this wait), only has its connection closed."""
    wait = END_OF_BODY_S
    if deadline is not None:
        wait = min(wait, deadline - asyncio.get_running_loop().time() - END_OF_BODY_MARGIN_S)
    if wait <= 0:
        return
    with contextlib.suppress(httpx.HTTPError, TimeoutError):
        async with asyncio.timeout(wait):
            for _ in range(END_OF_BODY_LINES):
                if await anext(body, None) is None:
                    return


def _refuses_running_usage(status: int, body: bytes) -> bool:
    """Whether the model server refused the request for the running-usage field alone: a
    strict server (OpenAI's own, or one validating against its schema) names the unknown
    field in its refusal."""
    return status in (400, 422) and RUNNING_USAGE_FIELD in body


def convert_transport_error(exc: httpx.HTTPError, base_url: str) -> PipelineError:
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError | httpx.PoolTimeout):
        return ServiceUnavailable(
            f"The model server at {base_url} cannot be reached ({type(exc).__name__}).",
            code="upstream_unavailable",
            headers=retry_after(1),  # every 503 says when to come back
        )
    if isinstance(exc, httpx.TimeoutException):
        return DeadlineExceeded(f"The model server did not answer in time ({type(exc).__name__}).")
    return UpstreamError(
        f"The connection to the model server broke ({type(exc).__name__}).",
        code="upstream_failed",
    )


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once per process and shared by every pool: making one
    reads the CA bundle (33 ms of CPU here), and a client makes nine pools."""
    return httpx.create_ssl_context()


def _proxied() -> bool:
    """Whether the environment names a proxy (which httpx's own transport honours)."""
    return any(scheme in urllib.request.getproxies() for scheme in ("http", "https", "all"))


class LLMClient:
    """Streams chat completions from one OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 60.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Whether to ask for the usage on every chunk; off once the server refuses it.
        self.running_usage = True
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The pools' transport: on ``pipeline.model.transport``'s asyncio layer, unless a test
        # gives one or the environment names a proxy (then httpx's own, which honours it).
        own_layer = transport is None and not _proxied()

        def pool(connections: int) -> httpx.AsyncClient:
            limits = httpx.Limits(
                max_connections=connections,
                max_keepalive_connections=connections,
                # Under the model server's own idle limit (vLLM's is 5 s, as uvicorn's): a
                # pooled connection is dropped here first, never closed by the server just as a
                # request goes out on it.
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
            return httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                verify=_tls(),
                timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=connect_timeout),
                limits=limits,
                transport=network.transport(verify=_tls(), limits=limits)
                if own_layer
                else transport,
            )

        # A transport given (a test's) is one pool's: it is not shared between clients.
        count = 1 if transport is not None else min(POOLS, max_connections)
        # Each pool its share (the first ones one more): max_connections together, exactly.
        self._shares = [
            max_connections // count + (i < max_connections % count) for i in range(count)
        ]
        self._pools = [pool(share) for share in self._shares]
        self._in_flight = [0] * count
        # A call holds one of these while it has a connection, so one over the limit waits
        # for the first connection that comes free in any pool (as long as httpx's own wait
        # for a pool's), and the pool it is then given has one free.
        self._connections = asyncio.Semaphore(max_connections)
        self._wait_s = connect_timeout
        # The readiness probe's own connection: never queued behind the calls.
        self.client = self._pools[0] if transport is not None else pool(1)

    @contextlib.asynccontextmanager
    async def _answering(self, payload: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """The model server's streamed response, its refusal raised. A server that refuses the
        running usage is asked again without it, and from then on never asked for it (the
        spend of a call cut short is then an estimate)."""
        await self._take_connection()
        pool = self._choose()  # nothing awaited between the slot and the try that gives it back
        self._in_flight[pool] += 1
        client = self._pools[pool]
        try:
            while True:
                running = self.running_usage
                options = STREAM_OPTIONS if running else FINAL_USAGE
                body = {**payload, "stream": True, "stream_options": options}
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code < 400:
                        yield response
                        return
                    refused = await response.aread()
                    if not (running and _refuses_running_usage(response.status_code, refused)):
                        raise upstream_error(response.status_code, refused, response.headers)
                if self.running_usage:
                    self.running_usage = False
                    log.warning(
                        "the model server at %s refuses stream_options.continuous_usage_stats: "
                        "asking it for the final usage only (a stream cut short is charged an "
                        "estimate)",
                        self.base_url,
                    )
        finally:
            self._in_flight[pool] -= 1
            self._connections.release()

    async def _take_connection(self) -> None:
        if not self._connections.locked():
            await self._connections.acquire()  # at once
            return
        try:
            async with asyncio.timeout(self._wait_s):
                await self._connections.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection to the model server came free") from None

    def _choose(self) -> int:
        """The first of the pools with the fewest calls in flight, among those with a free
        connection (one has: the calls in flight are fewer than the connections)."""
        free = [i for i, calls in enumerate(self._in_flight) if calls < self._shares[i]]
        return min(free, key=self._in_flight.__getitem__)

    async def stream_chat(
        self, payload: dict[str, Any], *, deadline: float | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the upstream's SSE chunks as dicts; raise a ``PipelineError`` on any failure.
        ``deadline`` (event-loop time): the caller's bound on its reads, which this keeps
        clear of (the caller enforces it)."""
        try:
            async with self._answering(payload) as response:
                started = finished = done = False
                body = lines(response.aiter_bytes())
                async for line in body:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        await _read_to_end(body, deadline)
                        break
                    chunk = _chunk(data)
                    if "error" in chunk:
                        raise _stream_error(chunk, started)
                    started = True
                    finished = finished or _finishes(chunk)
                    yield chunk
                if not (done and finished):
                    missing = "[DONE]" if finished else "a finish reason"
                    raise UpstreamError(
                        f"The model server's stream ended without {missing}: the answer may be "
                        "cut short.",
                        code="upstream_failed",
                    )
        except httpx.HTTPError as exc:
            raise convert_transport_error(exc, self.base_url) from exc

    async def healthy(self, probe_timeout: float = 2.0) -> bool:
        try:
            response = await self.client.get("/health", timeout=probe_timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        for client in {id(c): c for c in (*self._pools, self.client)}.values():
            await client.aclose()
