"""HTTP/1.1 pipelining under the service's protocol (``app.http.server``), on asyncio's loop and
on uvloop (the service's), against real sockets: a client that leaves is seen by the request
running, whether its next requests were sent with it, after it, or not at all; the requests it
left waiting never run; and pipelined requests are answered whole and in order, however their
bytes are cut, with what one connection buffers bounded."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from app.http.errors import install_error_handlers
from app.http.server import (
    BACKLOG_BYTES,
    MAX_HEAD_BYTES,
    MAX_PIPELINED,
    PIECE_BYTES,
    BoundedHttpToolsProtocol,
)
from tests.support.servers import free_port

LEAVE_BOUND_S = 10.0  # how long the running request may take to hear of it (it takes ms)

# Heads the parser refuses (the first: not HTTP at all).
INVALID = [
    b"NOT HTTP\r\n\r\n",
    b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
    b"POST / HTTP/1.1\r\ncontent-length: x\r\n\r\n",
    b"GET / HTTP/1.1\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
]
REFUSED = {
    "a head too large": b"HTTP/1.1 431",
    "a head too slow": b"HTTP/1.1 408",
    "not HTTP": b"HTTP/1.1 400",
}


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return asyncio.run if request.param == "asyncio" else uvloop.run


class App:
    """``/hold``: reads its body, then waits for the next ASGI message (the client's leaving) or
    for ``release``, and answers. ``/echo``: answers its path and body, counted in ``ran``."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.heard: list[str] = []
        self.ran: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/early":  # answered before its body is read (as a 404, a 413)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"5")],
                }
            )
            await send({"type": "http.response.body", "body": b"early"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.heard.append(message["type"])
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/poll":  # a receive now and then while it runs (a slot's waits)
            for _ in range(12):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(receive(), 0.02)
        if scope["path"] == "/listen":
            # As Starlette's streamed response and ``app.http.disconnect`` do: a receive for the
            # client's leaving, held while the answer is written (it resumes reading).
            watch = asyncio.ensure_future(receive())
            await asyncio.sleep(0.002)
            watch.cancel()
        if scope["path"] == "/hold":
            self.started.set()
            release = asyncio.ensure_future(self.release.wait())
            message = asyncio.ensure_future(receive())
            await asyncio.wait([release, message], return_when=asyncio.FIRST_COMPLETED)
            if message.done():
                self.heard.append(message.result()["type"])
            release.cancel()
            message.cancel()
            answer = b"held"
        else:
            self.ran.append(scope["path"])
            answer = scope["path"].encode() + b":" + body
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})


class QuickHeads(BoundedHttpToolsProtocol):
    head_timeout_s = 0.3


@asynccontextmanager
async def serving(
    app: Any, protocol: type[BoundedHttpToolsProtocol] = BoundedHttpToolsProtocol
) -> AsyncIterator[uvicorn.Server]:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=free_port(),
        http=protocol,
        timeout_keep_alive=1,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        server.force_exit = True
        await task


def request(path: str, body: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


async def answers(reader: asyncio.StreamReader, count: int) -> list[bytes]:
    """The bodies of the next ``count`` responses (each with a content-length)."""
    bodies = []
    for _ in range(count):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        bodies.append(await reader.readexactly(length))
    return bodies


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(LEAVE_BOUND_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within {LEAVE_BOUND_S} s")


@pytest.mark.parametrize("next_requests", ["none", "sent with it", "sent once it runs"])
def test_the_running_request_hears_its_client_leave(run: Any, next_requests: str) -> None:
    # uvicorn told only the newest request of a connection, and stopped reading the socket
    # while one waited its turn: the running one (a stream, a call queued for a slot) went on
    # for nobody.
    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            following = request("/echo", b"next") * 3
            writer.write(request("/hold") + (following if next_requests == "sent with it" else b""))
            await asyncio.wait_for(app.started.wait(), LEAVE_BOUND_S)
            if next_requests == "sent once it runs":
                writer.write(following)
                await writer.drain()
                await asyncio.sleep(0.1)  # the server has them before the client leaves
            writer.close()
            await wait_until(lambda: bool(app.heard), "the running request heard nothing")
            assert app.heard == ["http.disconnect"]
            await asyncio.sleep(0.2)
            assert app.ran == [], "a request its client left waiting ran for nobody"

    run(scenario())


def test_pipelined_requests_are_answered_in_order_and_reading_pauses_past_the_bound(
    run: Any,
) -> None:
    count = 200
    smallest = len(request("/echo/0"))

    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(request("/hold"))
            await asyncio.wait_for(app.started.wait(), LEAVE_BOUND_S)
            for i in range(count):  # one write each: the server reads them one by one
                writer.write(request(f"/echo/{i}", b"x" * i))
                await writer.drain()
            (protocol,) = server.server_state.connections
            await wait_until(
                lambda: len(protocol.pipeline) >= MAX_PIPELINED, "the requests' arrival"
            )
            await asyncio.sleep(0.2)
            # Past the bound (overshot by what one piece given to the parser holds at most)
            # the rest stays unparsed and reading pauses, until the queue moves.
            assert (
                MAX_PIPELINED <= len(protocol.pipeline) <= MAX_PIPELINED + PIECE_BYTES // smallest
            )
            assert protocol.flow.read_paused
            app.release.set()
            bodies = await asyncio.wait_for(answers(reader, count + 1), LEAVE_BOUND_S)
            assert bodies == [b"held"] + [f"/echo/{i}:".encode() + b"x" * i for i in range(count)]
            writer.close()

    run(scenario())


def assert_openai_error(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error


async def refusal(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: bytes
) -> None:
    """What is left to read, to the server's end of the connection, is a refusal with
    ``status`` in OpenAI's error shape."""
    rest = await asyncio.wait_for(reader.read(), LEAVE_BOUND_S)
    writer.close()
    assert rest.startswith(b"HTTP/1.1 " + status), rest
    assert_openai_error(rest)


@settings(max_examples=25, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=12),
    invalid=st.none() | st.sampled_from(INVALID),
)
def test_pipelined_requests_cut_anywhere_are_answered_whole_and_in_order(
    bodies: list[bytes], cuts: list[int], invalid: bytes | None
) -> None:
    # A request the parser refuses, after them, is answered last: a 400 in OpenAI's shape, then
    # the end of the connection.
    data = b"".join(request(f"/echo/{i}", body) for i, body in enumerate(bodies))
    data += invalid or b""
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})

    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            for start, end in itertools.pairwise(points):
                writer.write(data[start:end])
                await writer.drain()
                await asyncio.sleep(0)
            got = await asyncio.wait_for(answers(reader, len(bodies)), LEAVE_BOUND_S)
            if invalid is not None:
                await refusal(reader, writer, b"400")
            writer.close()
        assert got == [f"/echo/{i}:".encode() + body for i, body in enumerate(bodies)]

    uvloop.run(scenario())


@pytest.mark.parametrize("fault", list(REFUSED))
def test_a_refused_request_is_answered_after_the_answers_before_it(run: Any, fault: str) -> None:
    # The 431 or 408 was written at once: into the middle of the running request's response.
    async def scenario() -> None:
        app = App()
        async with serving(app, QuickHeads) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(request("/hold"))
            await asyncio.wait_for(app.started.wait(), LEAVE_BOUND_S)
            if fault == "a head too large":
                writer.write(b"GET / HTTP/1.1\r\nx-big: " + b"a" * MAX_HEAD_BYTES)
            elif fault == "a head too slow":
                writer.write(b"GET / HTTP/1.1\r\nx-half: ")
            else:
                writer.write(INVALID[0])
            await writer.drain()
            await asyncio.sleep(2 * QuickHeads.head_timeout_s)
            assert not app.heard, "the running request was told its client left"
            app.release.set()
            rest = await asyncio.wait_for(reader.read(), LEAVE_BOUND_S)  # to the server's EOF
            writer.close()
            refused = REFUSED[fault]
            assert rest.startswith(b"HTTP/1.1 200"), rest[:200]
            assert rest.index(b"held") < rest.index(refused), rest[:400]
            assert rest.count(b"HTTP/1.1 ") == 2, rest[:400]
            assert_openai_error(rest[rest.index(refused) :])

    run(scenario())


@pytest.mark.parametrize("head", INVALID)
def test_a_request_the_parser_refuses_gets_a_400_in_openais_shape(run: Any, head: bytes) -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(head)
            await refusal(reader, writer, b"400")
        assert app.ran == []

    run(scenario())


CHUNKED = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("behind", [False, True], ids=["alone", "pipelined"])
def test_a_body_the_parser_refuses_is_that_requests_400_and_it_hears_its_client_gone(
    run: Any, behind: bool
) -> None:
    # The 400 waited for the answer of the very request whose body was broken, which never
    # came: no answer, the connection and the request's task held until the client left.
    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            if behind:
                writer.write(request("/hold"))
                await asyncio.wait_for(app.started.wait(), LEAVE_BOUND_S)
            writer.write(CHUNKED + b"3\r\nabc\r\nZZ\r\n")
            await writer.drain()
            if behind:
                await asyncio.sleep(0.2)
                assert not app.heard, "the running request was told its client left"
                app.release.set()
                assert await asyncio.wait_for(answers(reader, 1), LEAVE_BOUND_S) == [b"held"]
            await refusal(reader, writer, b"400")
            await wait_until(lambda: not server.server_state.tasks, "the requests' tasks ending")
            assert app.ran == [], "the request with the broken body was answered as if whole"

    run(scenario())


def test_a_chunked_bodys_trailers_are_bounded_as_a_head_is(run: Any) -> None:
    # Trailers are headers after a chunked body, built by concatenation as a head's are, and
    # were bounded by nothing: a client could send them for ever, at a cost quadratic in their
    # length.
    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(CHUNKED + b"3\r\nabc\r\n0\r\nx-trailer: ")
            for _ in range(2 * MAX_HEAD_BYTES // PIECE_BYTES):
                writer.write(b"a" * PIECE_BYTES)
            await refusal(reader, writer, b"431")
            assert app.ran == []

    run(scenario())


@pytest.mark.parametrize(
    ("rest", "status"),
    [(b"3\r\nabc\r\nZZ\r\n", 400), (b"0\r\nx-trailer: " + b"a" * 2 * MAX_HEAD_BYTES, 431)],
    ids=["a chunk it cannot read", "trailers too large"],
)
def test_the_service_records_a_refused_bodys_status_not_a_client_that_left(
    run: Any, rest: bytes, status: int
) -> None:
    # The request heard its client gone, so the service's handler recorded a 499
    # (client_closed_request) in the log, the metrics and the span, though the client was
    # answered a 400 or a 431 and had not left.
    async def scenario() -> None:
        service = FastAPI()
        install_error_handlers(service)

        @service.post("/echo")
        async def echo(request: Request) -> dict[str, int]:
            return {"bytes": len(await request.body())}

        recorded: list[int] = []

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            async def record(message: Any) -> None:
                if message["type"] == "http.response.start":
                    recorded.append(message["status"])
                await send(message)

            await service(scope, receive, record)

        async with serving(recording) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(CHUNKED + b"3\r\nabc\r\n" + rest)
            await writer.drain()
            await refusal(reader, writer, str(status).encode())
            await wait_until(lambda: not server.server_state.tasks, "the request's task ending")
        assert recorded == [status]

    run(scenario())


def test_what_a_connection_keeps_unparsed_is_bounded_while_its_requests_listen(run: Any) -> None:
    # Each request's receive (listening for the client's leaving) resumed reading, and each
    # read joined the bytes kept unparsed: a client that kept sending grew them without bound.
    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            flood = request("/listen") * (BACKLOG_BYTES // len(request("/listen")))
            seen = [0]

            async def discard() -> None:
                while await reader.read(1 << 16):
                    pass

            async def sample() -> None:
                while True:
                    seen.extend(len(p._backlog) for p in server.server_state.connections)
                    await asyncio.sleep(0.001)

            tasks = [asyncio.ensure_future(discard()), asyncio.ensure_future(sample())]
            for _ in range(16):  # 4 MiB, more than the socket buffers hold
                writer.write(flood)
            await wait_until(lambda: len(app.ran) >= 300, "300 answers")
            writer.close()
            for task in tasks:
                task.cancel()
            # One read past the bound at most (a read is at most 256 KiB on either loop).
            assert max(seen) <= BACKLOG_BYTES + 262_144, max(seen)

    run(scenario())


@pytest.mark.parametrize("then", ["half a head", "nothing"])
def test_a_connection_answered_before_its_body_arrived_is_not_held_open(
    run: Any, then: str
) -> None:
    # The rest of the body came after the answer and cancelled uvicorn's keep-alive timer,
    # which only an answer arms; half a head in the same read started no head timer: either
    # way the connection stayed open for ever, with nothing to read.
    async def scenario() -> None:
        app = App()
        async with serving(app, QuickHeads) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(b"POST /early HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n")
            writer.write(b"a" * 50)
            assert await asyncio.wait_for(answers(reader, 1), LEAVE_BOUND_S) == [b"early"]
            writer.write(
                b"a" * 50 + (b"GET / HTTP/1.1\r\nx-half: " if then == "half a head" else b"")
            )
            rest = await asyncio.wait_for(reader.read(), LEAVE_BOUND_S)  # to the server's EOF
            writer.close()
            if then == "half a head":
                assert rest.startswith(b"HTTP/1.1 408"), rest
                assert_openai_error(rest)
            else:
                assert rest == b"", rest  # closed as idle, after uvicorn's keep-alive timeout

    run(scenario())


def test_a_waiting_requests_body_is_bounded_while_the_running_one_receives(run: Any) -> None:
    # Each receive of the running request resumed reading, and each read joined the body of the
    # request waiting behind it: 3 MiB held, past uvicorn's own 64 KiB bound.
    size = 3 * 1024 * 1024

    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(request("/poll") + request("/echo", b"b" * size))
            held = [0]

            async def sample() -> None:
                while True:
                    for protocol in server.server_state.connections:
                        if protocol.pipeline:
                            held.append(len(protocol.cycle.body))
                    await asyncio.sleep(0.001)

            sampling = asyncio.ensure_future(sample())
            got = await asyncio.wait_for(answers(reader, 2), 3 * LEAVE_BOUND_S)
            sampling.cancel()
            writer.close()
            assert got[1] == b"/echo:" + b"b" * size
            # uvicorn pauses reading past 64 KiB of a body; one read more may join it.
            assert max(held) <= 65_536 + 262_144, max(held)

    run(scenario())


def test_after_an_upgrade_it_cannot_make_nothing_is_read_as_a_request(run: Any) -> None:
    # The parser stops at an upgrade it was not given and loses what it was fed after it; fed
    # again from the next piece, it read a request out of the middle of a body.
    upgrade = b"GET /u HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
    inner = b"GET /smuggled HTTP/1.1\r\nhost: t\r\n\r\n"
    head = b"POST /p HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (4000 + len(inner))
    body = b"z" * (PIECE_BYTES - len(upgrade) - len(head)) + inner  # the inner request begins
    body += b"z" * (4000 + len(inner) - len(body))  # the second piece given to the parser

    async def scenario() -> None:
        app = App()
        async with serving(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
            writer.write(upgrade + head + body)
            rest = await asyncio.wait_for(reader.read(), LEAVE_BOUND_S)  # to the server's EOF
            writer.close()
        assert rest.count(b"HTTP/1.1 ") == 1 and b"/u:" in rest, rest
        assert app.ran == ["/u"], app.ran

    run(scenario())
