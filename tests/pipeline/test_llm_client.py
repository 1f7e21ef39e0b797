"""The model client's streams end cleanly: a finished answer leaves its connection for the
next (against the real vLLM, counted by a proxy in front of it), and whatever follows
``[DONE]`` neither fails nor holds a complete answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from typing import Any

import httpx
import orjson
import pytest

from pipeline.errors import InvalidRequest
from pipeline.model import client as client_module
from pipeline.model.chat import _read as read_before
from pipeline.model.client import LLMClient
from pipeline.watchdog import Watchdog
from tests.support.faultproxy import FaultProxy
from tests.support.strict_gateway import refusal, unknown_parameter


def ask(max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Name one colour."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def answer(client: LLMClient) -> list[dict[str, Any]]:
    return [chunk async for chunk in client.stream_chat(ask())]


def finished(chunks: list[dict[str, Any]]) -> bool:
    return any(choice.get("finish_reason") for c in chunks for choice in c.get("choices", []))


async def test_finished_streams_reuse_one_connection_to_vllm(vllm) -> None:
    with FaultProxy(vllm.url) as proxy:
        client = LLMClient(proxy.url)
        try:
            answers = [await answer(client) for _ in range(3)]
        finally:
            await client.aclose()
    assert all(finished(chunks) for chunks in answers)
    # Before: the body's end was left unread after [DONE], so httpx closed the connection and
    # each answer opened a new one (3 here).
    assert proxy.accepted == 1


def sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + event + b"\n\n" for event in events)


CHUNKS = [
    orjson.dumps({"choices": [{"index": 0, "delta": {"content": "Blue"}, "finish_reason": None}]}),
    orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
]


class AfterDone(httpx.AsyncByteStream):
    """A stream body: an answer, ``[DONE]``, then ``tail`` (and then, with ``hang``, nothing
    for a minute: a server that never ends the body)."""

    def __init__(self, tail: bytes, *, hang: bool) -> None:
        self.tail = tail
        self.hang = hang
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield sse(*CHUNKS, b"[DONE]")
        if self.tail:
            yield self.tail
        if self.hang:
            await asyncio.sleep(60)

    async def aclose(self) -> None:
        self.closed = True


def deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks]


async def stream_after_done(
    tail: bytes, *, hang: bool, deadline: float | None = None
) -> tuple[list[dict[str, Any]], float]:
    """The chunks of one answer from a server sending ``AfterDone``, read as the traced call
    reads them (each read bounded by ``deadline``), and how long that took."""
    body = AfterDone(tail, hang=hang)
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=body
        )
    )
    client = LLMClient("http://llm", transport=transport)
    started = time.monotonic()
    chunks = []
    watchdog = Watchdog()
    try:
        async with aclosing(client.stream_chat(ask(), deadline=deadline)) as stream:
            while (chunk := await read_before(stream, deadline, watchdog)) is not None:
                chunks.append(chunk)
    finally:
        watchdog.close()
        await client.aclose()
    assert body.closed
    return chunks, time.monotonic() - started


async def test_a_body_that_never_ends_after_done_does_not_hold_the_answer() -> None:
    chunks, took = await stream_after_done(b"", hang=True)
    assert deltas(chunks) == [{"content": "Blue"}, {}]
    assert finished(chunks)
    # Held for the short wait for the body's end, not for the server's minute (a hang).
    assert took < 30


async def test_lines_after_done_are_not_part_of_the_answer() -> None:
    junk = b"data: {not json\n\n" + sse(CHUNKS[0]) + b"data: " + b"x" * 10_000 + b"\n\n" * 20
    chunks, _ = await stream_after_done(junk, hang=False)
    assert deltas(chunks) == [{"content": "Blue"}, {}]
    chunks, _ = await stream_after_done(junk, hang=True)
    assert deltas(chunks) == [{"content": "Blue"}, {}]


async def test_the_wait_for_the_body_end_never_runs_into_the_callers_deadline(monkeypatch) -> None:
    # The wait is longer than the time left: it must stop short of the deadline, or the
    # caller's bound expires in it and a complete answer ends as a 504.
    monkeypatch.setattr(client_module, "END_OF_BODY_S", 5.0)
    deadline = asyncio.get_running_loop().time() + 1.0
    chunks, _ = await stream_after_done(b"", hang=True, deadline=deadline)
    assert deltas(chunks) == [{"content": "Blue"}, {}]


class StrictServer:
    """A model server that checks request bodies as OpenAI's API does: it refuses an unknown
    ``stream_options`` field, and with ``refusing`` set, every request (naming that field)."""

    def __init__(self, *, refusing: str | None = None) -> None:
        self.refusing = refusing
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        self.bodies.append(body)
        if param := self.refusing or unknown_parameter(body):
            return httpx.Response(400, json=refusal(param))
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=sse(*CHUNKS, b"[DONE]")
        )


async def test_a_server_that_refuses_the_running_usage_is_asked_without_it_from_then_on() -> None:
    server = StrictServer()
    client = LLMClient("http://llm", transport=httpx.MockTransport(server))
    try:
        first, second = await answer(client), await answer(client)
    finally:
        await client.aclose()
    assert deltas(first) == deltas(second) == [{"content": "Blue"}, {}]
    options = [body["stream_options"] for body in server.bodies]
    # Refused once, asked again at once without it, and never asked for it again.
    final_only = {"include_usage": True}
    assert options == [client_module.STREAM_OPTIONS, final_only, final_only], options
    assert not client.running_usage


async def test_a_refusal_of_another_field_is_the_callers_and_keeps_the_running_usage() -> None:
    server = StrictServer(refusing="logit_bias")
    client = LLMClient("http://llm", transport=httpx.MockTransport(server))
    try:
        with pytest.raises(InvalidRequest) as refused:
            await answer(client)
    finally:
        await client.aclose()
    assert (refused.value.code, refused.value.param) == ("upstream_rejected", "logit_bias")
    assert len(server.bodies) == 1  # not asked again
    assert client.running_usage


async def test_a_server_that_refuses_the_field_even_when_not_sent_is_asked_twice_at_most() -> None:
    # A server naming the field in every refusal (whatever the body): one retry, then its 400.
    server = StrictServer(refusing="stream_options.continuous_usage_stats")
    client = LLMClient("http://llm", transport=httpx.MockTransport(server))
    try:
        with pytest.raises(InvalidRequest):
            await answer(client)
    finally:
        await client.aclose()
    assert len(server.bodies) == 2


class CountingUpstream:
    """``bench.fake_upstream`` in this process, counting the connections it accepts and how
    many are open at once."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.accepted = 0
        self.open = 0
        self.most_open = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CountingUpstream:
        from bench.fake_upstream import handle

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            try:
                await handle(reader, writer, self.interval_s)
            finally:
                self.open -= 1

        self._server = await asyncio.start_server(counted, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


def pooled(client: LLMClient) -> list[int]:
    """The connections each of the client's pools holds (httpcore's pool, read as it is)."""
    return [len(pool._transport._pool.connections) for pool in client._pools]  # type: ignore[attr-defined]


async def test_concurrent_calls_are_spread_over_the_pools_and_a_lone_call_reuses_the_first() -> (
    None
):
    """httpcore walks every connection of a pool on each call: concurrent calls go to the pool
    with the fewest in flight, so no pool holds more than its share; one call at a time always
    takes the first pool, so it reuses one connection, as before."""
    async with CountingUpstream(interval_s=0.02) as upstream:
        client = LLMClient(upstream.url)
        try:
            answers = await asyncio.gather(*(answer(client) for _ in range(16)))
            assert all(finished(chunks) for chunks in answers)
            assert upstream.accepted == 16  # one connection per stream
            assert max(pooled(client)) <= -(-16 // client_module.POOLS)
            assert len(client._pools) == client_module.POOLS
            for _ in range(3):
                assert finished(await answer(client))
            assert upstream.accepted == 16  # each lone call reused the first pool's connection
        finally:
            await client.aclose()


@pytest.mark.parametrize("limit", [4, 9, 20])
async def test_the_pools_together_hold_no_more_connections_than_the_client_may_open(
    limit: int,
) -> None:
    """Fewer connections than pools, and a limit the pools do not divide: never more open."""
    async with CountingUpstream(interval_s=0.02) as upstream:
        # Half the calls wait for a connection: a wait as long as a starved machine needs
        # (the default 2 s could end in a PoolTimeout there), as this is about counts.
        client = LLMClient(upstream.url, max_connections=limit, connect_timeout=30.0)
        try:
            answers = await asyncio.gather(
                *(answer(client) for _ in range(2 * limit)), return_exceptions=True
            )
            failed = [a for a in answers if isinstance(a, BaseException)]
            assert not failed, failed[:3]
            assert all(finished(chunks) for chunks in answers if isinstance(chunks, list))
            assert upstream.most_open <= limit, (upstream.most_open, upstream.accepted)
            assert client._connections._value == limit  # every call gave its connection back
        finally:
            await client.aclose()


async def test_a_call_over_the_limit_takes_the_first_connection_freed_in_any_pool() -> None:
    """Two connections, two pools: a long call in one, a short one in the other; a third call
    waits for the short one's connection, not for the pool it would have been given."""
    async with CountingUpstream(interval_s=0.02) as upstream:
        # A wait as long as a starved machine needs: what shows the connection it got is that
        # it ends while the long call still runs (a wait for that call's pool would not).
        client = LLMClient(upstream.url, max_connections=2, connect_timeout=30.0)
        try:
            long = asyncio.create_task(answer_of(client, 1000))  # about 20 s
            short = asyncio.create_task(answer_of(client, 3))  # about 0.1 s
            await asyncio.sleep(0.05)
            assert finished(await answer_of(client, 3))
            assert not long.done(), "the third call waited for the long call's connection"
            assert finished(await short)
            long.cancel()
            with suppress(asyncio.CancelledError):
                await long
        finally:
            await client.aclose()


async def test_the_readiness_probe_is_never_queued_behind_the_calls() -> None:
    async with CountingUpstream(interval_s=0.02) as upstream:
        client = LLMClient(upstream.url, max_connections=1)
        try:
            streaming = asyncio.create_task(answer_of(client, 100))  # the only connection
            await asyncio.sleep(0.05)
            assert await client.healthy(probe_timeout=0.5)
            assert finished(await streaming)
        finally:
            await client.aclose()


async def answer_of(client: LLMClient, tokens: int) -> list[dict[str, Any]]:
    return [chunk async for chunk in client.stream_chat(ask(tokens))]
