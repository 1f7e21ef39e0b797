"""The model client's own network layer (``pipeline.model.transport``) against real sockets, on
asyncio's loop and on uvloop (the service's): a streamed answer arrives whole on one reused
connection, and every fault a model server can cause (silence, a reset, a cut, a close while
idle, a refused port, a slow reader or writer, a certificate not trusted) becomes the same error
it was on httpx's own backend."""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpcore
import httpx
import orjson
import pytest
import uvloop
from hypothesis import example, given
from hypothesis import strategies as st

from pipeline.answer.events import ContentDelta, Finish, ToolCallDelta, Usage, events_from_chunk
from pipeline.errors import DeadlineExceeded, PipelineError, ServiceUnavailable, UpstreamError
from pipeline.model import client as client_module
from pipeline.model import transport as network
from pipeline.model.client import LLMClient, lines
from tests.support.tls import self_signed

Script = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return asyncio.run if request.param == "asyncio" else uvloop.run


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(content: str, finish: str | None = None) -> bytes:
    delta = {"content": content} if content else {}
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return piece(b"data: " + orjson.dumps(chunk) + b"\n\n")


def answer(*words: str) -> bytes:
    """A whole streamed answer: the words, a finish reason, ``[DONE]``, the body's end."""
    events = [event(w) for w in words] + [event("", "stop"), piece(b"data: [DONE]\n\n")]
    return HEAD + b"".join(events) + END


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's body (the head read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


class Server:
    """A model server on a real socket: each connection runs ``script(number, reader, writer)``
    (``number`` counts connections from 0)."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.script = script
        self.tls = tls
        self.port = port
        self.accepted = 0
        self.url = ""

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://localhost:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number, self.accepted = self.accepted, self.accepted + 1
        try:
            await self.script(number, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def keep_answering(
    number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    while True:
        await read_request(reader)
        writer.write(answer("Blue", " sky"))
        await writer.drain()


def ask() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Name one colour."}]}


async def words(client: LLMClient) -> str:
    out = []
    async for chunk in client.stream_chat(ask()):
        out += [c["delta"].get("content", "") for c in chunk["choices"]]
    return "".join(out)


async def words_from(url: str, **options: Any) -> str:
    client = LLMClient(url, **options)
    try:
        return await words(client)
    finally:
        await client.aclose()


async def error_from(url: str, **options: Any) -> PipelineError:
    """The error one call to ``url`` raises."""
    with pytest.raises(PipelineError) as caught:
        await words_from(url, **options)
    return caught.value


async def failure(script: Script, **options: Any) -> PipelineError:
    """The error one call raises against a server running ``script``."""
    async with Server(script) as server:
        return await error_from(server.url, **options)


def test_the_pools_run_on_the_asyncio_backend_unless_the_environment_names_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def backends(client: LLMClient) -> set[type]:
        return {type(p._transport._pool._network_backend) for p in client._pools}  # type: ignore[attr-defined]

    for name in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    assert backends(LLMClient("http://llm")) == {network.AsyncioBackend}
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    # httpx's own transport, which honours the proxy.
    assert network.AsyncioBackend not in backends(LLMClient("http://llm"))


def test_streamed_answers_arrive_whole_on_one_reused_connection(run: Any) -> None:
    async def main() -> tuple[list[str], int]:
        async with Server(keep_answering) as server:
            client = LLMClient(server.url)
            try:
                got = [await words(client) for _ in range(5)]
            finally:
                await client.aclose()
        return got, server.accepted

    got, accepted = run(main())
    assert got == ["Blue sky"] * 5
    assert accepted == 1


def test_a_server_silent_mid_answer_is_a_504_after_the_read_timeout(run: Any) -> None:
    async def silent(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(HEAD + event("Blue"))
        await asyncio.sleep(30)

    error = run(failure(silent, read_timeout=0.3))
    assert isinstance(error, DeadlineExceeded)
    assert error.status_code == 504


def test_a_connection_reset_mid_answer_is_a_502(run: Any) -> None:
    async def reset(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(HEAD + event("Blue"))
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST

    error = run(failure(reset))
    assert isinstance(error, UpstreamError)
    assert (error.status_code, error.code) == (502, "upstream_failed")


def test_a_connection_closed_mid_answer_is_a_502_and_never_a_complete_answer(run: Any) -> None:
    async def cut(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + event("Blue"))
        await writer.drain()

    error = run(failure(cut))
    assert isinstance(error, UpstreamError)
    assert (error.status_code, error.code) == (502, "upstream_failed")


def test_a_port_that_refuses_is_a_503(run: Any) -> None:
    async def main() -> PipelineError:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, not listening: refused
            return await error_from(f"http://127.0.0.1:{port}")

    error = run(main())
    assert isinstance(error, ServiceUnavailable)
    assert error.code == "upstream_unavailable"


def test_a_pooled_connection_the_server_closed_while_idle_is_not_used_again(run: Any) -> None:
    async def once(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer("Blue"))  # keep-alive, as far as the headers say
        await writer.drain()
        await asyncio.sleep(0.02)  # then closed while idle

    async def main() -> tuple[list[str], int]:
        async with Server(once) as server:
            client = LLMClient(server.url)
            got = []
            try:
                for _ in range(3):
                    got.append(await words(client))
                    await asyncio.sleep(0.1)
            finally:
                await client.aclose()
        return got, server.accepted

    got, accepted = run(main())
    assert got == ["Blue"] * 3, "no call went out on a connection the server had closed"
    assert accepted == 3


def test_a_long_answer_read_slowly_arrives_whole_and_in_order(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A low mark: the protocol pauses and resumes the socket many times in one answer.
    monkeypatch.setattr(network, "HIGH_WATER", 4096)
    sent = [f"w{i:05d}" + "x" * 300 for i in range(3000)]

    async def fast(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(*sent))
        await writer.drain()

    async def main() -> list[str]:
        async with Server(fast) as server:
            client = LLMClient(server.url)
            got = []
            try:
                async for chunk in client.stream_chat(ask()):
                    got += [c["delta"]["content"] for c in chunk["choices"] if c["delta"]]
                    if len(got) % 100 == 0:
                        await asyncio.sleep(0.002)
            finally:
                await client.aclose()
        return got

    assert run(main()) == sent


def test_a_request_larger_than_the_socket_buffers_is_written_whole(run: Any) -> None:
    async def count(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await asyncio.sleep(0.2)  # the client's writes fill the buffers and wait
        body = orjson.loads(await read_request(reader))
        writer.write(answer(str(len(body["messages"][0]["content"]))))
        await writer.drain()

    async def main() -> str:
        async with Server(count) as server:
            client = LLMClient(server.url)
            payload = {"model": "m", "messages": [{"role": "user", "content": "x" * 8_000_000}]}
            try:
                return "".join(
                    [
                        c["delta"].get("content", "")
                        async for chunk in client.stream_chat(payload)
                        for c in chunk["choices"]
                    ]
                )
            finally:
                await client.aclose()

    assert run(main()) == "8000000"


def test_a_write_the_server_never_reads_times_out(run: Any) -> None:
    async def deaf(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def main() -> None:
        async with Server(deaf) as server:
            port = int(server.url.rsplit(":", 1)[1])
            stream = await network.AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=2)
            try:
                with pytest.raises(httpcore.WriteTimeout):
                    for _ in range(1000):  # until the socket buffers are full
                        await stream.write(b"x" * 1_000_000, timeout=0.2)
            finally:
                await stream.aclose()

    run(main())


def test_a_call_cancelled_mid_answer_frees_its_connection_for_the_next(run: Any) -> None:
    async def first_hangs(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if number > 0:
            await keep_answering(number, reader, writer)
            return
        await read_request(reader)
        writer.write(HEAD + event("Blue"))
        await asyncio.sleep(30)

    async def main() -> tuple[str, list[int], int]:
        async with Server(first_hangs) as server:
            client = LLMClient(server.url, max_connections=1)
            try:
                call = asyncio.ensure_future(words(client))
                await asyncio.sleep(0.2)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                after = await words(client)  # the one connection the client may hold
                return after, list(client._in_flight), server.accepted
            finally:
                await client.aclose()

    after, in_flight, accepted = run(main())
    assert after == "Blue sky"
    assert in_flight == [0]
    assert accepted == 2


def test_tls_answers_through_a_trusted_certificate_and_an_untrusted_one_is_refused(
    run: Any, tmp_path: Path
) -> None:
    server_tls, client_tls = self_signed(tmp_path, "localhost")
    limits = httpx.Limits(max_connections=2)

    async def main() -> tuple[str, bool, type[BaseException]]:
        async with Server(keep_answering, tls=server_tls) as server:
            trusting = network.transport(verify=client_tls, limits=limits)
            async with httpx.AsyncClient(transport=trusting, base_url=server.url) as client:
                body = {**ask(), "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    text = (await response.aread()).decode()
                    encrypted = response.extensions["network_stream"].get_extra_info("ssl_object")
            default = network.transport(verify=ssl.create_default_context(), limits=limits)
            async with httpx.AsyncClient(transport=default, base_url=server.url) as client:
                with pytest.raises(httpx.HTTPError) as refused:
                    await client.post("/v1/chat/completions", json=body)
        return text, encrypted is not None, type(refused.value)

    text, encrypted, refused = run(main())
    assert '"Blue"' in text and "[DONE]" in text
    assert encrypted
    assert refused is httpx.ConnectError  # the certificate: a 503, as on httpx's backend


def test_a_tls_server_that_hangs_up_at_once_is_a_503_never_a_502(run: Any) -> None:
    # A TLS balancer with no backend: accepts, then closes before any handshake. The close may
    # be read before the handshake starts (uvloop then returned a stream without TLS: a 502).
    async def main() -> list[PipelineError]:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        errors = []
        try:
            for number in range(12):
                errors.append(await error_from(f"https://127.0.0.1:{port}", connect_timeout=5))
                await asyncio.sleep(0.003 * (number % 4))  # the close read before or after
        finally:
            server.close()
        return errors

    errors = run(main())
    assert {(type(e), e.code) for e in errors} == {(ServiceUnavailable, "upstream_unavailable")}
    assert all("ConnectError" in e.message for e in errors), "at once, not a connect timeout"


def test_a_closed_connection_sends_nothing_more_to_a_server_that_stopped_reading(
    run: Any,
) -> None:
    # A call given up while its request is still being written: the rest of it must never
    # reach the model server (which would then answer for nobody).
    size = 32_000_000
    received: list[int] = []
    connected = asyncio.Event()

    async def slow_reader(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        connected.set()
        await asyncio.sleep(0.6)  # not reading while the client gives up
        total = 0
        try:
            while chunk := await reader.read(1 << 20):
                total += len(chunk)
        finally:
            received.append(total)

    async def main() -> None:
        async with Server(slow_reader) as server:
            client = LLMClient(server.url)
            payload = {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
            call = asyncio.ensure_future(anext(client.stream_chat(payload)))
            # Given up once its request is being written (a fixed 0.3 s from the start was,
            # on a loaded machine, before it had connected: then nothing reached the server,
            # and the test failed for want of a connection to look at).
            await asyncio.wait_for(connected.wait(), 30)
            await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await client.aclose()
            for _ in range(300):  # until the server has read to the end of what it got
                if received:
                    break
                await asyncio.sleep(0.05)

    run(main())
    assert received and received[0] < size, "the request's rest was dropped with the connection"


def dead_listener() -> tuple[socket.socket, int]:
    """A listener on 127.0.0.2 whose port is free on 127.0.0.1 too, where the test's server
    then listens (a port picked on 127.0.0.2 alone was once a connection's on 127.0.0.1)."""
    for _ in range(100):
        dead = socket.socket()
        dead.bind(("127.0.0.2", 0))
        port = dead.getsockname()[1]
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen(1)  # as the server will: a connection's local port conflicts here
        except OSError:
            dead.close()
            continue
        finally:
            probe.close()
        dead.listen(0)
        return dead, port
    raise AssertionError("no port free on both 127.0.0.1 and 127.0.0.2")


def test_a_host_whose_first_address_is_dead_is_reached_at_the_next(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A listener whose accept queue is full drops new SYNs: a dead address that does not refuse.
    dead, port = dead_listener()
    filler = socket.create_connection(("127.0.0.2", port))

    async def two_addresses(host: str, port: int) -> list[Any]:
        tcp = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(*tcp, ("127.0.0.2", port)), (*tcp, ("127.0.0.1", port))]

    monkeypatch.setattr(network, "_addresses", two_addresses)

    async def main() -> str:
        async with Server(keep_answering, port=port):
            return await words_from(f"http://llm.test:{port}", connect_timeout=3)

    try:
        assert run(main()) == "Blue sky"
    finally:
        filler.close()
        dead.close()


def test_a_stream_line_over_the_limit_is_a_502_malformed(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "MAX_LINE_BYTES", 4096)

    async def endless(
        number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(HEAD + piece(b"data: {"))
        for _ in range(100):  # one line, no end, in pieces
            writer.write(piece(b"x" * 1000))
            await writer.drain()
        await asyncio.sleep(30)

    error = run(failure(endless))
    assert isinstance(error, UpstreamError)
    assert (error.status_code, error.code) == (502, "upstream_malformed")


async def pieces(data: list[bytes]) -> AsyncIterator[bytes]:
    for item in data:
        yield item


@given(
    st.lists(
        st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), max_size=12
    ),
    st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=12, max_size=12),
    st.lists(st.integers(min_value=0, max_value=600), max_size=8),
)
def test_lines_are_split_alike_however_the_body_is_cut(
    texts: list[bytes], ends: list[bytes], cuts: list[int]
) -> None:
    whole = b"".join(text + end for text, end in zip(texts, ends, strict=False))
    points = sorted({min(c, len(whole)) for c in cuts} | {0, len(whole)})
    parts = [whole[a:b] for a, b in itertools.pairwise(points)]

    async def split() -> list[bytes]:
        return [line async for line in lines(pieces(parts))]

    got = asyncio.run(split())
    # Only empty lines may differ (a CRLF cut between two pieces gives one more).
    assert [line for line in got if line] == [text for text in texts if text]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
TOOL_CALL = st.fixed_dictionaries(
    {},
    optional={
        "index": JSON,
        "id": JSON,
        "function": JSON | st.fixed_dictionaries({}, optional={"name": JSON, "arguments": JSON}),
    },
)
# What a careless or hostile model server puts after "data: ".
EVENT = st.one_of(
    st.just(b"[DONE]"),
    st.binary(max_size=30),
    JSON.map(orjson.dumps),
    st.builds(
        lambda choices, usage: orjson.dumps({"choices": choices, "usage": usage}),
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "delta": JSON
                    | st.fixed_dictionaries({"content": JSON})
                    | st.fixed_dictionaries({"tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON}),
                    "finish_reason": JSON | st.just("stop"),
                    "index": JSON,
                },
            )
            | JSON,
            max_size=2,
        )
        | JSON,
        JSON,
    ),
    st.builds(
        lambda error: orjson.dumps({"error": error}), JSON | st.fixed_dictionaries({"code": JSON})
    ),
)


# Shapes that crashed the reading of chunks before (`make fuzz` finds them at once; the fixed
# examples of `make test` did not).
@example([b'{"choices": [1]}'], [], b"\n\n")
@example([b'{"choices": [{"delta": {"tool_calls": [{"function": "f"}]}}]}'], [], b"\n\n")
@example([b'{"choices": [], "usage": {"prompt_tokens": "x"}}'], [], b"\n\n")
@given(
    st.lists(EVENT, max_size=6),
    st.lists(st.integers(min_value=0, max_value=400), max_size=5),
    st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n"]),
)
def test_whatever_a_model_server_streams_is_events_or_a_pipeline_error(
    events: list[bytes], cuts: list[int], end: bytes
) -> None:
    # Never another exception, in the client or in reading its chunks: in the service it would
    # be a 500 (or an internal error ending a stream).
    whole = b"".join(b"data: " + event + end for event in events)
    points = sorted({min(c, len(whole)) for c in cuts} | {0, len(whole)})

    def server(request: httpx.Request) -> httpx.Response:
        parts = [whole[a:b] for a, b in itertools.pairwise(points)]
        return httpx.Response(200, stream=Pieces(parts))

    async def main() -> list[Any]:
        client = LLMClient("http://llm", transport=httpx.MockTransport(server))
        got: list[Any] = []
        try:
            async for chunk in client.stream_chat(ask()):
                assert isinstance(chunk, dict)
                got += events_from_chunk(chunk)
        except PipelineError:
            pass
        finally:
            await client.aclose()
        return got

    kinds = (ContentDelta, ToolCallDelta, Finish, Usage)
    for event in asyncio.run(main()):
        assert isinstance(event, kinds)
        if isinstance(event, ContentDelta):
            assert isinstance(event.text, str)
        if isinstance(event, ToolCallDelta):
            assert isinstance(event.arguments, str) and isinstance(event.name, str | None)


class Pieces(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
