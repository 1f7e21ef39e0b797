"""The HTTP/1.1 protocol the service runs under uvicorn: httptools', with a bound on the request
head (request line and headers) in size and in time, and pipelining that keeps answers in order,
bounds what a connection buffers, and tells the request running when its client leaves.

uvicorn's httptools protocol has neither: it grows the URL and each header value by bytes
concatenation, which is quadratic, so one 60 MB header cost 3 s of CPU on the event loop (200 MB:
48 s) before any route, the key check included, could refuse it; and a client that sends half a
head and then nothing holds its connection for ever. Here the bytes of a head are counted as
they arrive, before the parser sees them: past ``MAX_HEAD_BYTES`` the answer is a 431 and the
connection is closed; a head not complete within ``HEAD_TIMEOUT_S`` of its first byte gets a
408. Bodies are not counted here (``BodySizeLimit`` bounds them, after the key check).

Under HTTP/1.1 pipelining (a client sends its next request before the answer to the last),
uvicorn's protocol had these faults, each fixed here:

- **A client's leaving went unseen.** It stopped reading the socket while a request waited its
  turn, so the end of the connection was never read; and when the connection was lost it told
  only the newest request, not the one running. A streamed answer went on for nobody to its
  end, and a call queued for a route's slot (``app.http.disconnect``) waited and took it. Here
  the running request is told, and the socket is read on while fewer than ``MAX_PIPELINED``
  requests wait (or a waiting request's body passes 64 KiB, uvicorn's bound).
- **One read queued every request in it**: one 128 KiB read of 18-byte requests made 7,108
  waiting requests, 15 MiB of memory. Here the parser is given a read ``PIECE_BYTES`` at a time
  (a body of known length whole), and once ``MAX_PIPELINED`` wait, the rest is kept unparsed
  (``BACKLOG_BYTES`` at most, and one read) until the queue moves, reading paused.
- **A refusal was written at once**, into the middle of the answer before it (a 431, a 408, a
  400). Here it waits for the answers before it; a head's 10 s start once they are written. A
  refusal inside a request's body (a chunk the parser cannot read) is that request's answer:
  the request hears its client gone (and the service records the refusal's status, not a 499),
  and an answer already begun is ended by closing instead.
- **A request the parser cannot read** got a plain-text 400; here it is in OpenAI's error shape.

A chunked body's trailers (headers after its last chunk) are built up by the parser as a head
is, and were bounded by nothing: here they count as a head, 431 past ``MAX_HEAD_BYTES``.

Three more, from uvicorn, that pipelining or the pieces made easier to reach: a body that
arrives after its answer (a 404, a 413) cancelled the keep-alive timer and nothing armed it
again, and half a head in the same read was never timed, so the connection stayed open for ever
(here the head's time starts at the parser's first byte of it, and the idle connection gets its
keep-alive timeout); each ``receive`` of the running request let one more read into the body of
a request waiting its turn, past uvicorn's own 64 KiB (here reading waits); and after an upgrade
the parser cannot make, it parsed on from the next piece, which can lie inside a body (here the
request is answered and the connection closes, nothing after it read).

`rag serve` and the image's command run with it; by hand:
``uvicorn --http app.http.server:BoundedHttpToolsProtocol ...``.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT as HIGH_WATER
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from pipeline.errors import error_body

MAX_HEAD_BYTES: Final = 65_536
HEAD_TIMEOUT_S: Final = 10.0
# After a refusal the rest of what the client sends is read and dropped for this long before the
# connection closes: closing a socket with unread input resets it, and a client still sending
# would lose the answer to the reset (seen: a broken pipe instead of the 431).
LINGER_S: Final = 2.0
# Pipelined requests that wait their turn while the socket is still read; past it, reading
# pauses and what was read stays unparsed.
MAX_PIPELINED: Final = 8
# The most bytes of heads given to the parser at once: how far past MAX_PIPELINED one piece can
# queue requests (at most 113 of the smallest).
PIECE_BYTES: Final = 2048
# The most bytes read and kept unparsed (past it, by one read at most), while requests wait.
BACKLOG_BYTES: Final = 262_144
# The scope key under which a request whose body the protocol refused finds the status its
# client was answered with (it hears its client gone; the log and metrics record this status).
REFUSED_STATUS: Final = "rag.refused_status"


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


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The head's content-length (the parser has checked it), 0 where it has none."""
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() and len(value) < 20 else 0
    return 0


class _HeldFlow(FlowControl):
    """uvicorn's flow control, but reading does not resume while ``held()``: a request's
    ``receive`` resumes it each time (to see the client leave), and each time the next read
    would join what is kept unparsed, or the body of a request waiting its turn."""

    def __init__(self, transport: asyncio.Transport, held: Callable[[], bool]) -> None:
        super().__init__(transport)
        self.held = held

    def resume_reading(self) -> None:
        if not self.held():
            super().resume_reading()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools' protocol with the head of each request bounded in bytes and in time, and the
    client's leaving told to the request running, pipelined or not."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S
    linger_s = LINGER_S
    max_pipelined = MAX_PIPELINED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._refusal: bytes | None = None  # held until the responses before it are written
        self._running: RequestResponseCycle | None = None  # the cycle whose task runs now
        self._backlog = bytearray()  # bytes not parsed while ``max_pipelined`` requests wait
        self._body_left = 0  # of the body being read, by its content-length
        self._bodies = 0  # pieces of body the parser has given
        self._framing = 0  # bytes given in a body that gave no body: chunk lines, trailers
        self._head_begun = False  # the parser has begun a head it has not finished

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _HeldFlow(transport, self._held)

    def _held(self) -> bool:
        """Reading waits: the bytes kept unparsed are at their bound, or the request waiting
        last has more body than uvicorn lets one hold (read on, each request's ``receive``
        would add a read to it)."""
        if len(self._backlog) >= BACKLOG_BYTES:
            return True
        cycle = self.cycle
        return bool(self.pipeline) and cycle is not self._running and len(cycle.body) > HIGH_WATER

    @property
    def _answering(self) -> bool:
        """A request of this connection is being answered, or waits its turn."""
        running = self._running
        return bool(self.pipeline) or (
            running is not None and not running.response_complete and not running.disconnected
        )

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already: what follows is dropped unread
        if self._backlog:  # reading resumed (a request's receive does) while requests wait
            self._backlog += data
            self.flow.pause_reading()
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Give the parser ``data`` a piece at a time: no more of a head than its remaining
        budget, and no more than ``PIECE_BYTES`` at once, so that once ``max_pipelined``
        requests wait their turn the rest is held unparsed (``_backlog``), reading paused."""
        at, end = 0, len(data)
        view: memoryview | None = None
        while at < end:
            if len(self.pipeline) >= self.max_pipelined:
                self._backlog += data[at:]
                self.flow.pause_reading()
                return
            # A body of known length goes to the parser whole (it cannot hold a request).
            size = max(PIECE_BYTES, self._body_left)
            if self._in_head:
                if self._head_timer is None:
                    self._time_head()
                size = min(size, self.max_head_bytes - self._head_bytes)
                self._head_bytes += min(size, end - at)
            bodies = self._bodies
            if at == 0 and size >= end:
                super().data_received(data)  # all of it: most requests come in one piece
            else:
                view = view or memoryview(data)
                super().data_received(view[at : at + size])  # type: ignore[arg-type]
            if self.transport.is_closing() or self._refused:
                return
            if self._in_head:
                if self._head_bytes >= self.max_head_bytes:
                    self._refuse(TOO_LARGE)
                    return
            elif self._bodies == bodies:  # a chunked body's framing or trailers, which the
                # parser builds up by concatenation, as it did a head's (see above)
                self._framing += min(size, end - at)
                if self._framing >= self.max_head_bytes:
                    self._refuse(TOO_LARGE)
                    return
            else:
                self._framing = 0
            at += size

    def _time_head(self) -> None:
        """The head's time runs from its first byte, or from when the requests before it on
        this connection are answered: a head pipelined behind a long answer is not late."""
        if self._head_timer is None and not self._answering:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._refuse, TOO_SLOW)

    def on_message_begin(self) -> None:
        # The head's first byte, wherever it falls in a piece (one that began in a body, or
        # in the head before it, does not start the timer in ``_feed``).
        super().on_message_begin()
        self._head_begun = True
        self._time_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_begun = False
        self._cancel_timer()
        self._body_left = _content_length(self.headers)
        super().on_headers_complete()
        # uvicorn paused reading if this request was queued behind the running one: read on
        # while few wait, so the client's leaving is seen (see the module's docstring).
        if self.pipeline and len(self.pipeline) < self.max_pipelined:
            self.flow.resume_reading()

    def on_body(self, body: bytes) -> None:
        self._body_left -= len(body)
        self._bodies += 1
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request on this connection starts its own head
        self._head_bytes = 0
        self._body_left = 0
        self._framing = 0
        running = self._running
        if (
            running is not None
            and running.response_complete
            and not self.pipeline
            and self.timeout_keep_alive_task is None
            and not self._refused
        ):
            # Answered before its body was read (a 404, a 413): the rest of the body cancelled
            # uvicorn's keep-alive timer, which only an answer arms; the connection is idle now.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next request waiting, if any
        if not self._backlog and self._refusal is None and not self._head_begun:
            return  # nothing held back (most connections, most of the time)
        if self.transport.is_closing():
            return
        if self._backlog:  # never beside a refusal, which drops it
            self._feed_backlog()
        elif self._refusal is not None:
            if not self._answering:  # the responses before it are all written
                self._write_refusal(self._refusal)
        else:
            self._time_head()  # part of a head came while the last request was answered

    def _feed_backlog(self) -> None:
        backlog = bytes(self._backlog)
        self._backlog.clear()
        self._feed(backlog)
        if not self._backlog and not self._refused and len(self.pipeline) < self.max_pipelined:
            self.flow.resume_reading()  # uvicorn's resume came while the backlog was full

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        # uvicorn tells only ``self.cycle``, the newest request: under pipelining, one waiting
        # its turn (which then never starts), not the one running.
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def _cancel_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _unsupported_upgrade_warning(self) -> None:
        # The parser stops at an upgrade it was not given, and what it was fed after it is
        # lost; parsing on from the next piece could read a request out of the middle of a
        # body. The request is answered, then the connection closes; nothing after it is read.
        super()._unsupported_upgrade_warning()
        self.cycle.keep_alive = False
        self._refused = True
        self._backlog.clear()

    def send_400_response(self, msg: str) -> None:
        """A request the parser cannot read: uvicorn wrote its plain-text 400 at once (into the
        middle of the answers before it, under pipelining) and reset the connection."""
        self._refuse(_answer(b"400 Bad Request", msg))

    def _refuse(self, answer: bytes) -> None:
        """Answer once the requests before this one are answered (never in the middle of their
        responses), dropping what the client sends from now on."""
        self._cancel_timer()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._backlog.clear()
        broken = self.cycle
        if not self._in_head and broken is not None and broken.more_body:
            # Inside a request's body: the refusal is that request's answer. It hears that its
            # client is gone and, waiting its turn, leaves the queue.
            broken.scope[REFUSED_STATUS] = int(answer[9:12])  # type: ignore[typeddict-unknown-key]
            broken.disconnected = True
            broken.message_event.set()
            self.pipeline = deque(entry for entry in self.pipeline if entry[0] is not broken)
            if broken.response_started:  # answered, or being answered: nothing may follow
                answer = b""
        if self._answering:
            self._refusal = answer
        else:
            self._write_refusal(answer)

    def _write_refusal(self, answer: bytes) -> None:
        """Answer, end our side, drop what the client still sends, close after ``linger_s``."""
        self._refusal = None
        if answer:
            self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()  # to drop what is still sent, not leave it to a reset
        self.loop.call_later(self.linger_s, self.transport.close)
