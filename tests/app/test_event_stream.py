"""The streamed answer's response (``app.http.streaming``): a client that stops reading, or goes
away, ends the stream, and the source holding the model call and its route slot is closed at
once. The client here is an ASGI ``send`` that stops returning, as uvicorn's does while the
connection's buffers are full (the process-level case is ``test_upstream_fairness``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

from app.http.streaming import EventStreamResponse
from pipeline.answer.completion import Completion
from pipeline.model.slots import SlotPool
from pipeline.telemetry import metrics
from pipeline.watchdog import Watchdog

SCOPE: dict[str, Any] = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


def held_stream(pool: SlotPool, closed: asyncio.Event, pause: float = 0.0) -> AsyncIterator[bytes]:
    """An endless answer that holds a slot of ``pool`` while it is read, as a model call does."""

    async def body() -> AsyncIterator[bytes]:
        async with pool.slot("acme"):
            try:
                while True:
                    yield b"data: {}\n\n"
                    await asyncio.sleep(pause)
            finally:
                closed.set()

    return body()


def stalls() -> float:
    return metrics.STREAM_WRITE_STALLS._value.get()


def finished_for_followers() -> float:
    return metrics.STREAMS_FINISHED_FOR_FOLLOWERS._value.get()


async def test_a_client_that_stops_reading_ends_the_stream_and_frees_the_slot() -> None:
    pool, closed, never = SlotPool(1), asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    response = EventStreamResponse(
        held_stream(pool, closed), deadline=loop.time() + 60, write_stall_s=0.3
    )
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) > 5:
            await never.wait()  # the client's buffers are full and it reads no more

    async def receive() -> dict[str, Any]:
        await never.wait()  # connected all along: no disconnect tells the server
        return {"type": "http.disconnect"}

    before, started = stalls(), loop.time()
    await asyncio.wait_for(response(SCOPE, receive, send), 10)
    elapsed = loop.time() - started
    assert closed.is_set(), "the answer's source was left open"
    assert (pool.in_use, pool.held_by("acme")) == (0, 0), "the route slot is still held"
    assert response.stalled and stalls() == before + 1
    assert 0.3 <= elapsed < 3, f"ended after {elapsed:.2f} s with a 0.3 s stall limit"
    assert not any(m.get("more_body") is False for m in sent), "a stalled stream was completed"


async def test_no_send_waits_past_the_deadline_by_more_than_the_stall_limit() -> None:
    pool, closed, never = SlotPool(1), asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.4
    response = EventStreamResponse(
        held_stream(pool, closed, pause=0.02), deadline=deadline, write_stall_s=0.3
    )

    async def send(message: dict[str, Any]) -> None:
        if loop.time() > deadline:
            await asyncio.sleep(0.25)  # a slow reader: each send within the stall limit

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(response(SCOPE, receive, send), 10)
    ended = loop.time()
    assert closed.is_set() and pool.in_use == 0
    # Normally the last send ends about 0.25 s past the deadline; a stream that the deadline
    # did not end would go on until the 10 s wait_for above. 2 s past the stall limit leaves
    # a loaded machine room (it had 0.2 s) and still tells the two apart.
    assert ended <= deadline + 0.3 + 2.0, f"ran {ended - deadline:.2f} s past the deadline"


async def test_a_client_that_goes_away_frees_the_slot() -> None:
    pool, closed = SlotPool(1), asyncio.Event()
    loop = asyncio.get_running_loop()
    response = EventStreamResponse(
        held_stream(pool, closed, pause=0.01), deadline=loop.time() + 60, write_stall_s=5
    )
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 3:
            gone.set()  # the client closes the connection after a few chunks

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(response(SCOPE, receive, send), 10)
    assert closed.is_set() and (pool.in_use, pool.held_by("acme")) == (0, 0)
    assert not response.stalled


async def test_a_disconnect_in_the_same_turn_as_the_stall_limit_is_not_taken_for_a_stall() -> None:
    # The response's task group is cancelled (its client went away) by a callback that runs
    # right after the stall limit's own timer, in the same turn of the loop: the send ends
    # cancelled, as it would with no stall limit, and nothing counts a stall.
    loop, never = asyncio.get_running_loop(), asyncio.Event()
    response = EventStreamResponse(
        held_stream(SlotPool(1), asyncio.Event()), deadline=loop.time() + 60, write_stall_s=0.05
    )
    watchdog, seen = Watchdog(), []

    async def send(message: dict[str, Any]) -> None:
        await never.wait()

    async def writer() -> None:
        try:
            await response._send(send, {"type": "http.response.body", "body": b""}, watchdog)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            raise

    before = stalls()
    async with anyio.create_task_group() as group:
        group.start_soon(writer)
        await asyncio.sleep(0)  # the send has begun, under the watchdog's timer
        assert watchdog._timer is not None
        loop.call_at(watchdog._timer.when(), group.cancel_scope.cancel)
    watchdog.close()
    assert seen == ["CancelledError"] and stalls() == before


class Followers:
    """A shared answer (``SharedAnswer``, request coalescing's leader): what ``followed``
    answers (whether others read it), how often it was asked, whether it was let go, and
    whether it ends ``answered`` (its completion, once its source has ended) or failed."""

    def __init__(self, following: bool, answered: bool = True) -> None:
        self.following = following
        self.answered = answered
        self.asked = 0
        self.let_go_told = False
        self.ended = False

    @property
    def completion(self) -> Completion | None:
        if self.ended and self.answered:
            return Completion(content="done", finish_reason="stop", model="m")
        return None

    async def followed(self) -> bool:
        self.asked += 1
        return self.following

    def let_go(self) -> None:
        self.let_go_told = True


def leaving(gone: asyncio.Event) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` whose client leaves once ``gone`` is set."""

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


def counted_stream(
    made: list[int], closed: asyncio.Event, begun: asyncio.Event, chunks: int, answer: Followers
) -> AsyncIterator[bytes]:
    """An answer of ``chunks`` chunks, 20 ms apart, counting those made (``begun`` at 5);
    ``answer`` ends with its last one."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for n in range(chunks):
                made.append(n)
                if n == 5:
                    begun.set()
                yield b"data: {}\n\n"
                await asyncio.sleep(0.02)
            answer.ended = True
        finally:
            closed.set()

    return body()


def followed_answer(
    followers: Followers, write_stall_s: float, chunks: int = 200
) -> tuple[EventStreamResponse, list[int], asyncio.Event, asyncio.Event]:
    """The response of an answer of ``chunks`` chunks asking ``followers``; the chunks made,
    and events set when its source is closed and once 5 chunks are made."""
    made: list[int] = []
    closed, begun = asyncio.Event(), asyncio.Event()
    response = EventStreamResponse(
        counted_stream(made, closed, begun, chunks, followers),
        deadline=asyncio.get_running_loop().time() + 60,
        write_stall_s=write_stall_s,
        shared=followers,
    )
    return response, made, closed, begun


@pytest.mark.parametrize("stop", ["leaves", "stalls"])
async def test_an_answer_others_follow_is_read_on_while_they_do_when_its_client_goes(
    stop: str,
) -> None:
    # The leader's client leaving (or no longer reading) stopped a shared answer under its
    # followers (each ended with an error); now it is read on, sends skipped, until they have
    # all gone.
    followers, gone, never = Followers(following=True), asyncio.Event(), asyncio.Event()
    response, made, closed, begun = followed_answer(followers, write_stall_s=0.2)
    sent: list[dict[str, Any]] = []
    finished = finished_for_followers()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if stop == "stalls" and len(sent) > 3:
            await never.wait()

    served = asyncio.create_task(response(SCOPE, leaving(gone), send))
    await asyncio.wait_for(begun.wait(), 5)
    if stop == "leaves":
        gone.set()
    at_leaving = len(sent)
    await asyncio.sleep(1.0)
    assert not closed.is_set() and response.client_gone
    assert len(made) > 20, "read on for its followers"
    assert len(sent) <= at_leaving + 1, "nothing more sent"
    followers.following = False  # the last follower has its answer, or has gone
    await asyncio.wait_for(served, 5)
    assert closed.is_set() and len(made) < 200, "stopped once nobody followed"
    assert followers.asked >= 2
    assert finished_for_followers() == finished, "stopped midway: not finished for anyone"


async def served_to_a_client_that_leaves(
    response: EventStreamResponse, begun: asyncio.Event
) -> None:
    """Serve ``response`` to a client that leaves once ``begun``; return when it has ended."""
    gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        pass

    served = asyncio.create_task(response(SCOPE, leaving(gone), send))
    await asyncio.wait_for(begun.wait(), 5)
    gone.set()
    await asyncio.wait_for(served, 5)


@pytest.mark.parametrize("answered", [True, False])
async def test_an_answer_read_on_to_its_end_for_its_followers_is_counted_once_if_it_answered(
    answered: bool,
) -> None:
    # One that failed on the way (its error sent as an event: the body ends as any other)
    # was counted as finished for its followers.
    followers = Followers(following=True, answered=answered)
    response, made, closed, begun = followed_answer(followers, write_stall_s=5, chunks=40)
    finished = finished_for_followers()
    await served_to_a_client_that_leaves(response, begun)
    assert closed.is_set() and len(made) == 40, "read on to its end"
    assert finished_for_followers() == finished + answered
    assert not followers.let_go_told


async def test_an_answer_nobody_follows_stops_at_once_when_its_client_leaves() -> None:
    followers = Followers(following=False)
    response, made, closed, begun = followed_answer(followers, write_stall_s=5)
    await served_to_a_client_that_leaves(response, begun)
    assert closed.is_set() and len(made) < 12 and followers.asked == 1
    assert followers.let_go_told, "told it stops before it is cancelled"
