"""A TCP proxy that a test puts in front of Redis or vLLM and switches between faults at run time.

It runs on its own event loop in a thread, so a sync test (against a ``ServiceProcess``) and an
async one (against a ``LiveService`` or an in-process app) drive it alike; every switch returns
once the proxy has applied it. Modes, for the bytes of every connection through it:

- ``passing()``: bytes go through as they come (and a refusing proxy listens again);
- ``pause()``: bytes are held (both ways) until the next switch; new connections are accepted;
  ``resume()`` ends it and changes nothing else;
- ``hold_open(request)`` / ``release()``: the open connections whose last request line has
  ``request`` in it hold their bytes (both ways) until released, while the others and new ones
  pass (a streamed answer in flight stops, a health check goes on);
- ``hold_here()``, from an ``SSEEdit`` edit: that connection sends the events up to this one and
  holds the rest until ``release()`` (a streamed answer stops at an exact event, however many
  of its events one read brought);
- ``slow(seconds)``: each chunk waits that long first (requests only by default: for Redis that
  is a delay per command, a pipeline counting as one);
- ``refuse()``: the port stops listening (a stopped server: connection refused);
- ``answer(response)``: each new connection gets this raw HTTP response, upstream never called;
- ``rewrite(factory)``: each connection's upstream bytes, from its next answer on, pass through
  a ``factory()`` of its own (``SSEEdit`` rewrites streamed answers; ``CloseAfterBytes`` hangs up);

and one action, ``cut()``: close every open connection now. ``open_connections`` counts the
connections open through it; ``held`` the chunks a pause is holding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")
REQUEST_LINE = re.compile(rb"[A-Z]+ \S+ HTTP/1\.[01]\r\n")


class Rewriter(Protocol):
    """Rewrites one connection's upstream-to-client bytes; ``closed``: hang up after these."""

    closed: bool

    def feed(self, data: bytes) -> bytes: ...


RewriterFactory = Callable[[], Rewriter]


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, client: asyncio.StreamWriter, rewriter: Rewriter | None) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.rewriter = rewriter
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.request = b""  # the last request line sent upstream (HTTP)
        self.waiting = False  # a chunk of it is held at the gate now

    def close(self, *, reset: bool = False) -> None:
        for writer in (self.client, self.upstream):
            if writer is None or writer.is_closing():
                continue
            if reset:  # SO_LINGER 0: the close sends a RST, as a crashed peer's kernel would
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()

    async def wait_closed(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                with contextlib.suppress(OSError):
                    await writer.wait_closed()


class FaultProxy:
    """Listens on a free loopback port and forwards to ``upstream_url``'s host and port."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        assert parts.hostname is not None and parts.port is not None, upstream_url
        self.upstream_url = upstream_url
        self.upstream = (parts.hostname, parts.port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._listener: socket.socket | None = None
        self._starting: set[socket.socket] = set()  # accepted, their handler not yet begun
        self._handlers: set[asyncio.Task[None]] = set()
        self._links: set[_Link] = set()
        self._feeding: _Link | None = None  # the connection whose rewriter is being fed now
        self._flowing = asyncio.Event()
        self._delay = 0.0
        self._delay_responses = False
        self._answer: bytes | None = None
        self._rewriter: RewriterFactory | None = None
        self.accepted = 0
        self.held = 0

    # --- life ---

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen())
        self._loop.call_soon_threadsafe(self._flowing.set)
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        # A Runner, as asyncio.run: when the loop has stopped, what is left on it (a
        # connection's handler, a transport's connection_lost) runs to its end before it is
        # closed, so no socket is left to the garbage collector.
        with asyncio.Runner(loop_factory=lambda: self._loop) as runner:
            runner.get_loop().run_forever()

    @property
    def url(self) -> str:
        """``upstream_url`` with the proxy's address in place of the upstream's."""
        parts = urlsplit(self.upstream_url)
        netloc = f"127.0.0.1:{self.port}"
        if "@" in parts.netloc:
            netloc = parts.netloc.rsplit("@", 1)[0] + "@" + netloc
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def open_connections(self) -> int:
        return len(self._links)

    # --- switches (each returns once applied) ---

    def passing(self) -> None:
        self._set(delay=0.0, delay_responses=False, answer=None, rewriter=None, flowing=True)
        self._call(self._listen())

    def pause(self) -> None:
        self._set(flowing=False)

    def resume(self) -> None:
        """End a pause and nothing else (``passing()`` also drops a rewriter, a delay...)."""
        self._set(flowing=True)

    def slow(self, seconds: float, *, responses: bool = False) -> None:
        self._set(delay=seconds, delay_responses=responses, flowing=True)

    def refuse(self) -> None:
        self._call(self._stop_listening())

    def hold_open(self, request: bytes = b"") -> int:
        """Hold the bytes of the open connections whose last request line has ``request`` in
        it, until ``release()``; how many."""

        async def hold() -> int:
            held = [link for link in self._links if request in link.request]
            for link in held:
                link.flowing.clear()
            return len(held)

        return self._call(hold())

    def release(self) -> None:
        """Let the connections ``hold_open()`` held flow again."""

        async def release() -> None:
            for link in self._links:
                link.flowing.set()

        self._call(release())

    def answer(self, response: bytes) -> None:
        """Answer every request with ``response`` from now on; open connections are cut, so
        a pooled one cannot reach the upstream."""
        self._set(answer=response)
        self.cut()

    def rewrite(self, factory: RewriterFactory | None) -> None:
        self._set(rewriter=factory)

    def cut(self, *, reset: bool = False) -> int:
        """Close every open connection (with ``reset``: a RST); the number closed."""

        async def cut() -> int:
            links = list(self._links)
            for link in links:
                link.close(reset=reset)
            return len(links)

        return self._call(cut())

    def settled(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until at most ``count`` connections are open; whether that happened."""
        return self._call(_until(lambda: len(self._links) <= count, timeout), timeout + 5)

    def holding(self, timeout: float = 10.0) -> bool:
        """Wait until a pause holds at least one chunk; whether that happened."""
        return self._call(_until(lambda: self.held > 0, timeout), timeout + 5)

    def requests_open(self, request: bytes) -> int:
        """The open connections whose last request line has ``request`` in it (sent upstream,
        held or not)."""

        async def count() -> int:
            return sum(1 for link in self._links if request in link.request)

        return self._call(count())

    def holding_requests(self, request: bytes, count: int, timeout: float = 10.0) -> bool:
        """Wait until a pause (or ``hold_open``) holds at least ``count`` connections whose last
        request line has ``request`` in it, each with bytes waiting at the gate: that many such
        requests in flight at once; whether that happened."""

        def enough() -> bool:
            return sum(1 for k in self._links if k.waiting and request in k.request) >= count

        return self._call(_until(enough, timeout), timeout + 5)

    def hold_here(self) -> None:
        """From an ``SSEEdit`` edit (the proxy's own thread): the connection being fed sends the
        events up to and with this one, and holds the rest, and its bytes both ways, until
        ``release()``; the other connections flow on. Unlike ``pause_here()``, the events that
        came in the same read as this one wait too."""
        link = self._feeding
        assert link is not None and isinstance(link.rewriter, SSEEdit), "not in an SSEEdit edit"
        link.flowing.clear()
        link.rewriter.held = True

    def pause_here(self) -> None:
        """``pause()`` from the proxy's own thread (a rewriter's ``feed``, an ``SSEEdit`` edit):
        the chunk being fed still goes through, the next ones of every connection wait."""
        self._flowing.clear()

    # --- the loop's side ---

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _set(self, *, flowing: bool | None = None, **values: Any) -> None:
        async def apply() -> None:
            for name, value in values.items():
                setattr(self, f"_{name}", value)
            if "rewriter" in values:
                # Pooled keep-alive connections are between answers: they take it up too.
                for link in self._links:
                    link.rewriter = self._rewriter() if self._rewriter is not None else None
            if flowing is True:
                self._flowing.set()
            elif flowing is False:
                self._flowing.clear()

        self._call(apply())

    # Its own accept, not asyncio's Server: on Python 3.11 a Server closed (``refuse()``) between
    # accepting a connection and making its transport strands that transport half made (its
    # ``_attach`` asserts), and the garbage collector later warns "unclosed transport" in
    # whichever test is running. Here each accepted socket is handed to its handler at once.

    async def _listen(self) -> None:
        if self._listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", self.port))
                listener.listen(128)
                listener.setblocking(False)
            except BaseException:  # the port taken meanwhile: no socket left to the collector
                listener.close()
                raise
            self.port = listener.getsockname()[1]
            self._listener = listener
            self._loop.add_reader(listener.fileno(), self._take, listener)

    def _take(self, listener: socket.socket) -> None:
        """Accept every connection waiting, each given a handler task now."""
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left
            except OSError:
                # Out of descriptors or memory: the listener stays readable, so stop watching
                # it for a moment (as asyncio's Server does) instead of spinning on it.
                self._loop.remove_reader(listener.fileno())
                self._loop.call_later(0.2, self._watch_again, listener)
                return
            conn.setblocking(False)
            self._starting.add(conn)
            task = self._loop.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def _watch_again(self, listener: socket.socket) -> None:
        if self._listener is listener:  # not refused or shut down meanwhile
            self._loop.add_reader(listener.fileno(), self._take, listener)

    async def _serve(self, conn: socket.socket) -> None:
        self._starting.discard(conn)
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except (OSError, ValueError):  # closed by a shutdown before this began
            conn.close()
            return
        except BaseException:
            conn.close()
            raise
        await self._accept(reader, writer)

    async def _stop_listening(self) -> None:
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    async def _shutdown(self) -> None:
        await self._stop_listening()
        for conn in self._starting:  # accepted, their handler never begun
            conn.close()
        self._starting.clear()
        for link in list(self._links):
            link.close()
            link.flowing.set()
        self._flowing.set()
        await _until(lambda: not self._links, 5.0)  # each handler has closed its sockets

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(writer, self._rewriter() if self._rewriter is not None else None)
        self._links.add(link)
        try:
            if self._answer is not None:
                await _answer(reader, writer, self._answer)
                return
            try:
                up_reader, link.upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the upstream is down: the client sees its connection closed
            await _first(
                self._pump(reader, link.upstream, link, upstream_bound=True),
                self._pump(up_reader, writer, link, upstream_bound=False),
            )
        finally:
            link.close()
            await link.wait_closed()
            self._links.discard(link)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        upstream_bound: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if upstream_bound and REQUEST_LINE.match(data):
                    link.request = data.split(b"\r\n", 1)[0]
                await self._gate(upstream_bound, link)
                # this chunk's rewriter, kept while it is held (a switch meanwhile must not lose
                # the events it holds)
                rewriter = None if upstream_bound else link.rewriter
                if rewriter is not None:
                    self._feeding = link
                    data = rewriter.feed(data)
                    while isinstance(rewriter, SSEEdit) and rewriter.held:
                        # hold_here() in an edit: what came before it goes now, the rest
                        # (still in the rewriter) once the connection flows again
                        writer.write(data)
                        await writer.drain()
                        await self._gate(upstream_bound, link)
                        rewriter.held = False
                        self._feeding = link  # others were fed while this one waited
                        data = rewriter.feed(b"")
                writer.write(data)
                await writer.drain()
                if rewriter is not None and rewriter.closed:
                    return

    async def _gate(self, upstream_bound: bool, link: _Link) -> None:
        for flowing in (self._flowing, link.flowing):
            if not flowing.is_set():
                self.held += 1
                link.waiting = True
                try:
                    await flowing.wait()
                finally:
                    self.held -= 1
                    link.waiting = False
        if self._delay and (upstream_bound or self._delay_responses):
            await asyncio.sleep(self._delay)


async def _first(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run the two directions until either ends (a peer closed); cancel the other."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until(check: Callable[[], bool], within: float) -> bool:
    for _ in range(int(within / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def _answer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes
) -> None:
    """Read one HTTP request (head and a Content-Length body), send ``response``, hang up."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                await reader.readexactly(int(value))
        writer.write(response)
        await writer.drain()


def http_response(status: int, body: bytes, **headers: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection (for ``answer``)."""
    reason = {401: "Unauthorized", 403: "Forbidden", 429: "Too Many Requests"}.get(status, "")
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json"]
    lines += [f"content-length: {len(body)}", "connection: close"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class CloseAfterBytes:
    """Lets ``count`` bytes of the upstream's answer through, then hangs up."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.closed = False

    def feed(self, data: bytes) -> bytes:
        data, self.left = data[: self.left], self.left - len(data)
        self.closed = self.left <= 0
        return data


EventEdit = Callable[[int, bytes], "list[bytes] | None"]


class SSEEdit:
    """Rewrites the events of chunked ``text/event-stream`` answers; other answers pass as they
    are. ``edit(number, event)`` gets each event (``data: ...``, without its blank line) with
    its 0-based number and returns the events to send instead, or None to hang up at once
    (mid-answer, with no terminating chunk). A connection may carry several answers."""

    def __init__(self, edit: EventEdit) -> None:
        self.edit = edit
        self.closed = False
        self._buffer = b""
        self._head = True  # reading a response head
        self._sse = False
        self._chunk_left = -1  # -1: at a chunk-size line
        self._events = b""
        self._number = 0
        self.held = False  # hold_here() came in an edit: the rest waits for feed(b"")
        self._resume: bool | None = None  # held mid-flush: flush on, with this ``final``

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        if self._resume is not None:  # the events that waited behind hold_here() go first
            final, self._resume = self._resume, None
            out.append(self._flush_events(final=final))
        while not self.closed and not self.held:
            if self._head:
                head, sep, rest = self._buffer.partition(b"\r\n\r\n")
                if not sep:
                    break
                out.append(head + sep)
                self._buffer = rest
                lowered = head.lower()
                chunked = b"transfer-encoding: chunked" in lowered
                self._sse = chunked and b"text/event-stream" in lowered
                self._head = not chunked  # a Content-Length answer here is whole: pass it on
                self._number = 0
                if not chunked:
                    out.append(self._buffer)
                    self._buffer = b""
                    break
            elif self._chunk_left < 0:
                line, sep, rest = self._buffer.partition(b"\r\n")
                if not sep:
                    break
                self._buffer = rest
                self._chunk_left = int(line.split(b";")[0], 16)
                if self._chunk_left == 0:  # the last chunk (and its empty trailer line)
                    out.append(self._flush_events(final=True))
                    self._buffer = self._buffer.removeprefix(b"\r\n")
                    self._chunk_left, self._head = -1, True
            else:
                if len(self._buffer) < self._chunk_left + 2:
                    break
                body = self._buffer[: self._chunk_left]
                self._buffer = self._buffer[self._chunk_left + 2 :]
                self._chunk_left = -1
                if self._sse:
                    self._events += body
                    out.append(self._flush_events(final=False))
                else:
                    out.append(_chunk(body))
        return b"".join(out)

    def _flush_events(self, *, final: bool) -> bytes:
        out: list[bytes] = []
        *complete, self._events = self._events.split(b"\n\n")
        for index, event in enumerate(complete):
            replaced = self.edit(self._number, event)
            self._number += 1
            if replaced is None:
                self.closed = True
                return b"".join(out)
            out.extend(_chunk(item + b"\n\n") for item in replaced)
            if self.held:  # the events after this one wait, in front of what is still to come
                rest = b"".join(e + b"\n\n" for e in complete[index + 1 :])
                self._events = rest + self._events
                self._resume = final
                return b"".join(out)
        if final:
            out.append(_chunk(self._events) if self._events else b"")
            self._events = b""
            out.append(b"0\r\n\r\n")
        return b"".join(out)


def _chunk(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b""


# --- edits of a streamed chat answer ---


FINISH_REASON = re.compile(rb'"finish_reason": ?"[a-z_]+"')


def _is_done(event: bytes) -> bool:
    return event.strip() == b"data: [DONE]"


def malformed_line(after: int = 1) -> RewriterFactory:
    """A line that is not JSON, in place of the answer's event number ``after``."""
    return lambda: SSEEdit(lambda n, e: [b'data: {"choices": [{"delta": '] if n == after else [e])


def misshapen_chunk(after: int = 1) -> RewriterFactory:
    """A JSON object of another shape than a chunk's (a ``delta`` that is a string), in place of
    the answer's event number ``after``."""
    line = b'data: {"choices": [{"index": 0, "delta": "Blue"}]}'
    return lambda: SSEEdit(lambda n, e: [line] if n == after else [e])


def without_done() -> RewriterFactory:
    """The answer whole, but its ``data: [DONE]`` left out (the stream ends cleanly)."""
    return lambda: SSEEdit(lambda n, e: [] if _is_done(e) else [e])


def without_finish_reason() -> RewriterFactory:
    """The answer with every ``finish_reason`` made null (``[DONE]`` still sent)."""

    def edit(number: int, event: bytes) -> list[bytes]:
        return [FINISH_REASON.sub(b'"finish_reason":null', event)]

    return lambda: SSEEdit(edit)


def hold_after_content(proxy: FaultProxy, count: int) -> RewriterFactory:
    """The answers as they are until the ``count``-th event with text (counted across the
    proxy's connections): it goes through, and the rest of its answer waits, however it came
    (``hold_here()``), until ``proxy.release()``. Once only."""
    seen = 0

    def edit(number: int, event: bytes) -> list[bytes]:
        nonlocal seen
        if has_content(event):
            seen += 1
            if seen == count:
                proxy.hold_here()
        return [event]

    return lambda: SSEEdit(edit)


def has_content(event: bytes) -> bool:
    """Whether an event of a streamed chat answer carries text (its first choice's delta)."""
    if not event.startswith(b"data: {"):
        return False
    choices = json.loads(event[len(b"data: ") :]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def close_after_events(count: int) -> RewriterFactory:
    """The first ``count`` events of each answer, then the connection closed mid-answer."""
    return lambda: SSEEdit(lambda n, e: [e] if n < count else None)
