"""Graceful shutdown as the requests see it.

On SIGTERM, `rag serve` (``DrainingServer``, the image's command) keeps its socket open for the
grace period (``--timeout-graceful-shutdown``) while the requests already in flight finish.
Requests that arrive meanwhile, `/readyz` among them, get a 503 in OpenAI's shape (code
``shutting_down``, ``Retry-After``, ``Connection: close``): a load balancer stops sending, an
OpenAI client retries, and nobody meets a reset connection. Shortly before the grace ends
(``cut_margin``), what still runs is ended cleanly: a stream with a final ``error`` event, a
request not yet answered with the same 503. Then uvicorn's own shutdown runs: the socket closes,
the connections end and the lifespan closes the clients. Without a grace period, in-flight
requests are waited for as long as they take, as uvicorn does.

uvicorn alone closes its socket at once (new connections are refused) and, when the grace
ends, cancels what runs: a stream is cut off mid-answer without a word.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from dataclasses import dataclass
from typing import Final

import orjson
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.errors import error_body, retry_after

logger = logging.getLogger("uvicorn.error")

RETRY_AFTER_S: Final = 1.0
REFUSED: Final = error_body(
    "The server is shutting down; retry the request.", "service_unavailable", code="shutting_down"
)
CUT_REQUEST: Final = error_body(
    "The server is shutting down: the request was stopped before its answer; retry it.",
    "service_unavailable",
    code="shutting_down",
)
CUT_STREAM: Final = error_body(
    "The server is shutting down: the answer was cut short; retry the request.",
    "service_unavailable",
    code="shutting_down",
)


def cut_margin(grace_s: float) -> float:
    """How long before the end of the grace period what still runs is ended: time enough for
    the last frames to go out before uvicorn cancels what is left."""
    return min(1.0, grace_s / 4)


@dataclass
class _InFlight:
    started: bool = False  # the status line has gone out
    stream: bool = False  # an event stream
    ended: bool = False  # the last byte has gone out
    cut: bool = False

    @property
    def cuttable(self) -> bool:
        """Not answered yet, or a stream not yet ended (a plain body, once started, is
        written in one go and is left to finish)."""
        return not self.started or (self.stream and not self.ended)


class Shutdown:
    """The process's shutdown: not begun, draining (new requests refused), cut (what still
    runs is ended). One per app; `DrainingServer` drives it, `DrainOnShutdown` applies it."""

    def __init__(self) -> None:
        self.draining = False
        self._running: dict[asyncio.Task[object], _InFlight] = {}

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def begin(self) -> None:
        self.draining = True

    def cut(self) -> int:
        """End what can be ended of what still runs; the number of requests cut."""
        cut = 0
        for task, flight in list(self._running.items()):
            if flight.cuttable and not flight.cut:
                flight.cut = True
                task.cancel("the server is shutting down")
                cut += 1
        return cut


class DrainOnShutdown:
    """Refuses new requests once shutdown has begun; ends cut requests cleanly."""

    def __init__(self, app: ASGIApp, *, shutdown: Shutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.shutdown.draining:
            await _answer(send, REFUSED)
            return
        task = asyncio.current_task()
        assert task is not None
        flight = _InFlight()

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                flight.started = True
                flight.stream = any(
                    name == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", [])
                )
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                flight.ended = True
            await send(message)

        self.shutdown._running[task] = flight
        try:
            try:
                await self.app(scope, receive, tracked)
            except asyncio.CancelledError:
                if not flight.cut:
                    raise
                task.uncancel()  # our own cancellation: the request ends here, cleanly
            if flight.cut and not flight.ended:
                await _end(flight, send)
        finally:
            del self.shutdown._running[task]


async def _end(flight: _InFlight, send: Send) -> None:
    if not flight.started:
        await _answer(send, CUT_REQUEST)
    elif flight.stream:
        # The status line has gone out: as for any failure mid-stream, a last `error` event.
        body = b"data: " + orjson.dumps(CUT_STREAM) + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _answer(send: Send, error: dict[str, object]) -> None:
    body = orjson.dumps(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in retry_after(RETRY_AFTER_S).items()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining before it shuts down (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self.draining = shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown
        began = loop.time()
        self.draining.begin()
        logger.info("Draining: %d request(s) in flight; new ones get 503", self.draining.in_flight)
        if grace is None:
            await self._idle(None)
        else:
            margin = cut_margin(grace)
            if not await self._idle(began + grace - margin):
                logger.warning("Grace period ending: cutting %d request(s)", self.draining.cut())
                await self._idle(began + grace - margin / 2)
            # uvicorn's own wait gets what is left of the grace period (in its whole seconds),
            # not a second one.
            left = grace - (loop.time() - began)
            self.config.timeout_graceful_shutdown = max(0, math.ceil(left))
        await super().shutdown(sockets)

    async def _idle(self, until: float | None) -> bool:
        """Wait until no request is in flight (True) or ``until`` passes (False)."""
        loop = asyncio.get_running_loop()
        while self.draining.in_flight and not self.force_exit:
            if until is not None and loop.time() >= until:
                return False
            await asyncio.sleep(0.05)
        return True
