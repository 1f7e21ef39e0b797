"""The HTTP/1.1 protocol the service runs under uvicorn: httptools', with a bound on the request
head (request line and headers) in size and in time.

uvicorn's httptools protocol has neither: it grows the URL and each header value by bytes
concatenation, which is quadratic, so one 60 MB header cost 3 s of CPU on the event loop (200 MB:
48 s) before any route, the key check included, could refuse it; and a client that sends half a
head and then nothing holds its connection for ever. Here the bytes of a head are counted as
they arrive, before the parser sees them: past ``MAX_HEAD_BYTES`` the answer is a 431 and the
connection is closed; a head not complete within ``HEAD_TIMEOUT_S`` of its first byte gets a
408. Bodies are not counted here (``BodySizeLimit`` bounds them, after the key check).

`rag serve` and the image's command run with it; by hand:
``uvicorn --http app.http.server:BoundedHttpToolsProtocol ...``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeline.errors import error_body

MAX_HEAD_BYTES: Final = 65_536
HEAD_TIMEOUT_S: Final = 10.0
# After a refusal the rest of what the client sends is read and dropped for this long before the
# connection closes: closing a socket with unread input resets it, and a client still sending
# would lose the answer to the reset (seen: a broken pipe instead of the 431).
LINGER_S: Final = 2.0


def _answer(status: bytes, reason: str) -> bytes:
    body = json.dumps(error_body(reason, "invalid_request_error"), separators=(",", ":")).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


TOO_LARGE: Final = _answer(
    b"431 Request Header Fields Too Large",
    f"The request line and headers are longer than {MAX_HEAD_BYTES} bytes.",
)
TOO_SLOW: Final = _answer(
    b"408 Request Timeout",
    f"The request line and headers did not arrive within {HEAD_TIMEOUT_S:g} s.",
)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools' protocol with the head of each request bounded in bytes and in time."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S
    linger_s = LINGER_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already: what follows is dropped unread
        while data:
            if not self._in_head:
                super().data_received(data)
                return
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._refuse, TOO_SLOW)
            # A chunk may hold the end of a head and the start of its body (or of the next
            # request): the parser is given no more than the head's remaining budget at a time.
            budget = self.max_head_bytes - self._head_bytes
            head, data = data[:budget], data[budget:]
            self._head_bytes += len(head)
            super().data_received(head)
            if self.transport.is_closing() or self._refused:
                return
            if self._in_head and self._head_bytes >= self.max_head_bytes:
                self._refuse(TOO_LARGE)
                return

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request on this connection starts its own head
        self._head_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _cancel_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, answer: bytes) -> None:
        """Answer, end our side, drop what the client still sends, close after ``linger_s``."""
        self._cancel_timer()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.linger_s, self.transport.close)
