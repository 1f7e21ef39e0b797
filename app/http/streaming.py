"""The response of a streamed answer: its SSE chunks sent under a write-stall limit and the
request's deadline.

Starlette's ``StreamingResponse`` waits on each send for as long as the client takes, and
uvicorn's send waits while the connection's buffers are full: a client that opens a stream and
never reads would hold it, and with it the model call upstream and a slot of the route
(``pipeline.model.slots``), for ever. Here a send that does not complete within
``write_stall_s`` ends the response and the connection, and no send waits past the request's
deadline by more than that (the deadline itself bounds the upstream reads, ``pipeline.model.
chat``; the grace lets the error event that says so go out). However the response ends
(finished, stalled, the client gone), the chunk source is closed at once rather than left to the
garbage collector, so the upstream request is closed and its slot freed.

Except for others: when the client leaves an answer that other requests follow (request
coalescing, ``SharedAnswer``), or stops reading it, it is read on for them, its chunks sent nowhere,
instead of stopped midway under them: to its end, the deadline, or until nobody follows it
(asked again every ``FOLLOWED_CHECK_S`` while it is read on).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from starlette._utils import create_collapsing_task_group
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from pipeline.answer.completion import Completion
from pipeline.telemetry import metrics
from pipeline.watchdog import Watchdog

logger = logging.getLogger(__name__)

FOLLOWED_CHECK_S = 0.5


class WriteStalled(Exception):
    """A send to the client did not complete within the limit."""


class SharedAnswer(Protocol):
    """An answer other requests may follow (request coalescing): ``pipeline.answer.stream.
    AnswerStream``."""

    @property
    def completion(self) -> Completion | None:
        """The whole answer, once it has ended well (None before, or when it failed)."""

    async def followed(self) -> bool:
        """Whether others read it now (False: it stops for them)."""

    def let_go(self) -> None:
        """Nobody follows it and its reader leaves: told before it is cancelled."""


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        deadline: float,
        write_stall_s: float,
        headers: Mapping[str, str] | None = None,
        shared: SharedAnswer | None = None,
    ) -> None:
        """``deadline``: the request's, in event-loop time; ``write_stall_s``: the longest one
        send may wait for the client; ``shared``: the answer, where others may follow it."""
        super().__init__(content, headers=headers, media_type=self.media_type)
        self.deadline = deadline
        self.write_stall_s = write_stall_s
        self.stalled = False
        self.shared = shared
        self.client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # As Starlette's (ASGI before 2.4): the response is cancelled when its client leaves,
        # unless others follow the answer: then it is read on, and its sends skipped.
        async with create_collapsing_task_group() as task_group:

            async def respond() -> None:
                await self.stream_response(send)
                task_group.cancel_scope.cancel()

            task_group.start_soon(respond)
            while (await receive())["type"] != "http.disconnect":
                pass
            if self.client_gone or await self._read_on():
                return  # read on for others (already, after a stall; or from now)
            task_group.cancel_scope.cancel()

    async def _followed(self) -> bool:
        """Whether others follow the answer. When not, the answer stops, and ``let_go`` says
        so at once: its cancellation reaches the answer's source only after the model call's
        close (which awaits the network), and a request of the key joining meanwhile would
        follow an answer about to stop (a review's reproducer)."""
        if self.shared is None:
            return False
        if await self.shared.followed():
            return True
        self.shared.let_go()
        return False

    async def _read_on(self) -> bool:
        """Whether the answer is read on, sends skipped, now that its client is gone or stalled
        (others follow it); sets ``client_gone`` when it is."""
        if not await self._followed():
            return False
        self.client_gone = True
        return True

    async def stream_response(self, send: Send) -> None:
        # One timer for all of the response's sends, not one per chunk (``pipeline.watchdog``).
        watchdog = Watchdog()
        try:
            await self._send(
                send,
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                },
                watchdog,
            )
            checked = anyio.current_time()
            async for chunk in self.body_iterator:
                if self.client_gone:  # read on for others while they follow
                    if anyio.current_time() - checked >= FOLLOWED_CHECK_S:
                        checked = anyio.current_time()
                        if not await self._followed():
                            return
                    continue
                body = (
                    chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                )
                message = {"type": "http.response.body", "body": body, "more_body": True}
                try:
                    await self._send(send, message, watchdog)
                except WriteStalled:
                    self._stalled()
                    if not await self._read_on():
                        return
                    checked = anyio.current_time()
            if self.client_gone and self.shared is not None and self.shared.completion is not None:
                # Read on to its end for its followers (one that failed ended with an error
                # event: a body that ends like any other).
                metrics.stream_finished_for_followers()
            end = {"type": "http.response.body", "body": b"", "more_body": False}
            await self._send(send, end, watchdog)
        except WriteStalled:
            self._stalled()
        finally:
            watchdog.close()
            # Even when cancelled (the client went away): closing frees the route's slot.
            with anyio.CancelScope(shield=True):
                await _aclose(self.body_iterator)

    def _stalled(self) -> None:
        # The response stays incomplete: the server closes the connection.
        self.stalled = True
        metrics.stream_write_stalled()
        logger.warning("a streamed answer was ended: its client stopped reading")

    async def _send(self, send: Send, message: Message, watchdog: Watchdog) -> None:
        if self.client_gone:
            return  # read on for the followers of the answer: nobody to send to
        now = anyio.current_time()
        try:
            with watchdog.until(min(now, self.deadline) + self.write_stall_s):
                await send(message)
        except TimeoutError as exc:
            # A cancellation of the response (its client went away) that came in the same
            # turn is that, not a stall: anyio delivers it here.
            await anyio.lowlevel.checkpoint_if_cancelled()
            raise WriteStalled() from exc


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
