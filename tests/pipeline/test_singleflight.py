"""Request coalescing's mechanism (``pipeline.store.singleflight``) against a real Redis: one
leader per key across two replicas' flight registries, its answer to every follower (a stream
from its first event), its error passed on, a silent leader taken over once its lock expires,
and Redis trouble turning coalescing off. The whole service is in tests/app/test_coalescing.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import orjson
import pytest
from opentelemetry import trace
from starlette.responses import JSONResponse

from app.http.streaming import EventStreamResponse
from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    AnswerEvent,
    Citation,
    CitedSource,
    ContentDelta,
    Finish,
    ToolCallDelta,
    Usage,
)
from pipeline.answer.stream import AnswerStream
from pipeline.errors import (
    ClientClosedRequest,
    ContextTooLong,
    DeadlineExceeded,
    StoreBusy,
    StoreUnavailable,
    UpstreamBusy,
)
from pipeline.store.flight_entries import Entry, MalformedEntry, entry_from_wire, entry_wire
from pipeline.store.kv import KeyValueStore
from pipeline.store.singleflight import Leader, Shared, SingleFlight, _Led
from pipeline.telemetry import attributes as attr
from tests.support.faultproxy import FaultProxy
from tests.support.servers import RedisServer, free_port
from tests.support.tracing import memory_tracing

TRACER = trace.get_tracer("test")
EVENTS: list[AnswerEvent] = [
    ContentDelta("Paris", ({"token": "Paris", "logprob": -0.1},)),
    ContentDelta(" is."),
    Citation(0, 0, 9, True, (CitedSource(1, "d1", "d1#0", 0, 5, 0.8),)),
    ToolCallDelta(0, "call_1", "lookup", '{"q": 1}'),
    Finish("stop"),
    Usage(7, 3),
]
ANSWER = Completion(content="Paris is.", finish_reason="stop", model="smollm2")


@pytest.fixture
async def kv(redis_server) -> AsyncIterator[KeyValueStore]:
    # A 10 s command timeout: a command slower than the default 0.5 s on a loaded machine
    # would turn coalescing off ("off", as with Redis down, which has a test of its own).
    store = KeyValueStore.from_url(redis_server.url, TRACER, timeout=10.0)
    yield store
    await store.aclose()


@pytest.fixture
async def flights() -> AsyncIterator[Callable[..., SingleFlight]]:
    """Makes one replica's registry (``prefix`` shared: the replicas of one deployment); its
    publishers and readers are stopped when the test ends."""
    made: list[SingleFlight] = []

    def make(kv: KeyValueStore, **options: int) -> SingleFlight:
        made.append(SingleFlight(kv, prefix="tflight:", **options))
        return made[-1]

    yield make
    for registry in made:
        await registry.aclose()


def key() -> str:
    return f"acme:{uuid.uuid4().hex}"


async def settled(check: Callable[[], bool], seconds: float = 15.0) -> None:
    """Wait until ``check()`` holds (it fails the test after ``seconds``)."""
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never settled")


def following(key: str, *replicas: SingleFlight) -> int:
    """How many requests wait on the key's flight as followers (in these replicas), counted in
    each replica's registry: what a test waits for before the leader ends, where a sleep could
    let a slow follower join only after the end (and lead a flight of its own)."""
    flights = (replica._flights.get(key) for replica in replicas)
    return sum(flight.readers for flight in flights if flight is not None)


async def deadline(seconds: float = 20.0) -> float:
    return asyncio.get_running_loop().time() + seconds


def publish(leader: Leader, events: list[AnswerEvent], completion: Completion | None) -> None:
    leader.lead(still_shared=lambda: True, storable=lambda c: c.finish_reason == "stop")
    for event in events:
        leader.event(event)
    if completion is not None:
        leader.ended(completion, None)


async def streamed_leader(
    replica: SingleFlight, the_key: str, until: float, published: list[AnswerEvent]
) -> Leader:
    """The leader of a new streamed flight of ``the_key``, with ``published`` out already."""
    leading = await replica.share(the_key, stream=True, deadline=until)
    assert leading.leader is not None
    publish(leading.leader, published, None)
    return leading.leader


async def no_reader_counted(kv: KeyValueStore, leader: Leader, *replicas: SingleFlight) -> None:
    """Once the replicas' readers have gone, the flight's count of them is gone (not below 0)."""
    await settled(lambda: not any(replica._flights for replica in replicas))
    assert await kv.get(leader.flights.readers_key(leader.flight.key, leader.flight.token)) is None


async def drain(shared: Shared) -> list[AnswerEvent]:
    assert shared.events is not None
    return [event async for event in shared.events]


def test_entries_keep_every_event_the_completion_and_the_error_class_on_the_wire() -> None:
    events = entry_from_wire(entry_wire(Entry("events", tuple(EVENTS))))
    assert events.events == tuple(EVENTS)
    done = entry_from_wire(entry_wire(Entry("done", completion=ANSWER, shared=True)))
    assert done.completion == ANSWER and done.shared and done.terminal
    error = ContextTooLong("This model's maximum context length is 2048 tokens.")
    failed = entry_from_wire(entry_wire(Entry("failed", error=error)))
    assert type(failed.error) is ContextTooLong
    assert failed.error.to_dict() == error.to_dict()
    busy = UpstreamBusy("small", retry_after_s=3)
    again = entry_from_wire(entry_wire(Entry("failed", error=busy))).error
    assert isinstance(again, UpstreamBusy) and again.route == "small"
    assert again.headers == {"Retry-After": "3"}


async def request(
    replica: SingleFlight, the_key: str, joined: list[Shared], until: float, variant: str = ""
) -> None:
    """A request's part: join, and (a leader) stay alive until the test ends it, as a request
    does while it generates (a leader's flight ends with its request)."""
    shared = await replica.share(the_key, stream=False, deadline=until, variant=variant)
    joined.append(shared)
    if shared.role == "leader":
        await asyncio.sleep(30)


async def test_one_of_many_concurrent_requests_leads_and_the_others_get_its_answer(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    replicas = [flights(kv), flights(kv)]  # two replicas' registries, one Redis
    the_key, until, joined = key(), await deadline(), []
    requests = [
        asyncio.create_task(request(replicas[i % 2], the_key, joined, until)) for i in range(20)
    ]
    await settled(lambda: bool(joined) and following(the_key, *replicas) == 19)  # all joined
    assert [shared.role for shared in joined] == ["leader"]
    assert joined[0].leader is not None
    publish(joined[0].leader, EVENTS, ANSWER)
    await settled(lambda: len(joined) == 20)
    assert all(f.role == "follower" and f.completion == ANSWER for f in joined[1:])
    for task in requests:
        task.cancel()


async def test_a_streamed_follower_that_joins_late_gets_every_event_from_the_first(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:2])  # before anyone follows
    local = await here.share(the_key, stream=True, deadline=until)
    remote = await there.share(the_key, stream=True, deadline=until)
    assert local.role == remote.role == "follower"
    reading = [asyncio.create_task(drain(local)), asyncio.create_task(drain(remote))]
    await asyncio.sleep(0.3)
    assert not any(task.done() for task in reading)  # they follow the answer as it comes
    for event in EVENTS[2:]:
        leader.event(event)
    leader.ended(ANSWER, None)
    for task in reading:
        assert await task == EVENTS
    assert local.final is not None and local.final() == ANSWER


async def test_a_leader_knows_whether_it_is_followed_here_or_on_another_replica(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    # What a streamed leader whose client leaves asks: followed, it finishes the answer for
    # its followers (app.http.streaming) instead of stopping it midway under them.
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:1])
    # (Nobody following, the answer ends when asked: the test below.)
    remote = await there.share(the_key, stream=True, deadline=until)
    assert remote.role == "follower" and await leader.followed()
    local = await here.share(the_key, stream=True, deadline=until)
    reading = [asyncio.create_task(drain(local)), asyncio.create_task(drain(remote))]
    for event in EVENTS[1:]:
        leader.event(event)
    leader.ended(ANSWER, None)
    for task in reading:
        assert await task == EVENTS
    assert not await leader.followed(), "ended: nobody reads it any more"
    await no_reader_counted(kv, leader, there)


async def on_redis(kv: KeyValueStore, leader: Leader, entries: int) -> list[Entry]:
    """The flight's stream on Redis, once it holds ``entries`` entries (the publisher sends
    in batches of its own)."""
    stream = leader.flights.stream_key(leader.flight.key, leader.flight.token)
    for _ in range(750):
        held = [entry_from_wire(fields[b"e"]) for _, fields in await kv.xrange(stream)]
        if len(held) >= entries:
            return held
        await asyncio.sleep(0.02)
    raise AssertionError(f"the stream never held {entries} entries: {held}")


@pytest.mark.parametrize("saw_the_lock", ["after", "before"])
async def test_a_request_on_another_replica_that_comes_as_its_leader_stops_leads_anew(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], saw_the_lock: str
) -> None:
    # The leader's client has left and no replica reads its stream: the answer stops. The
    # leader read the count of readers, and the flight's end reached Redis a round trip or
    # more later: a request on another replica joining in between followed the answer so far,
    # then ended midway with coalesced_leader_gone. Now one script reads the count and, when
    # it is 0, ends the flight there: the lock is released, and a replica that saw it held
    # just before ("before": it decided to read the stream, and counts its reader in after
    # the script) reads only the end from the stream, so its request joins again.
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:2])
    assert [entry.kind for entry in await on_redis(kv, leader, 1)] == ["events"]
    if saw_the_lock == "before":  # as there._remote() does when it finds the lock held
        seen = _Led(there, the_key, uuid.uuid4().hex)
        there._flights[the_key] = seen
    assert not await leader.followed(), "nobody follows it, here or there"
    assert await kv.get(here.lock_key(the_key)) is None, "the lock is released with the end"
    if saw_the_lock == "before":
        there._read_from(seen, leader.flight.token.encode())
    joined = await there.share(the_key, stream=True, deadline=until)
    assert joined.role == "leader", "it led the key's next flight, having relayed nothing"
    assert joined.leader is not None
    publish(joined.leader, EVENTS, ANSWER)
    assert [entry.kind for entry in await on_redis(kv, leader, 1)] == ["gone"]
    leader.ended(None, None)  # the stopped answer's own end changes nothing on Redis
    await settled(lambda: not here._flights)
    assert [entry.kind for entry in await on_redis(kv, leader, 1)] == ["gone"]


async def test_a_request_that_joins_here_while_the_leader_asks_redis_counts_as_following(
    redis_server: RedisServer, flights: Callable[..., SingleFlight]
) -> None:
    # The leader's client has left and its response asks whether the answer is followed: the
    # local count first, then Redis for a replica's reader. A request of the key joining here
    # while Redis answers (no Redis needed to join) was not counted, so the answer was
    # stopped under it midway (a review's reproducer: coalesced_leader_gone after 30 events).
    with FaultProxy(redis_server.url) as proxy:
        slow = KeyValueStore.from_url(proxy.url, TRACER, timeout=10.0)
        try:
            here = flights(slow)
            the_key, until = key(), await deadline()
            leader = await streamed_leader(here, the_key, until, EVENTS[:1])
            proxy.pause()  # Redis is slow to answer (a fork, a slow command, the network)
            asking = asyncio.create_task(leader.followed())
            await asyncio.sleep(0.2)
            assert not asking.done(), "followed() should be waiting for Redis's count"
            joined = await here.share(the_key, stream=True, deadline=until)
            assert joined.role == "follower"
            proxy.resume()
            assert await asking, "a follower joined before the answer came: it is followed"
            reading = asyncio.create_task(drain(joined))
            publish(leader, EVENTS[1:], ANSWER)
            assert await reading == EVENTS
            # No replica read it, so it was ended on Redis: it is read on for this one alone.
            assert [entry.kind for entry in await on_redis(slow, leader, 1)] == ["gone"]
        finally:
            await slow.aclose()


@pytest.mark.parametrize("how", ["gone", "unshared"])
async def test_a_request_that_comes_as_its_leader_stops_leads_anew_rather_than_fail_midway(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], how: str
) -> None:
    # The leader's client left and nobody followed (or a search of the answer saw another
    # index version): the answer stops for its followers, and the flight's last entry reaches
    # this process's followers once Redis has it. A request joining in between followed the
    # answer so far, then ended midway with coalesced_leader_gone.
    here = flights(kv)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:2])
    if how == "gone":
        leader.ended(None, None)  # its reader let go
    else:
        leader.still_shared = lambda: False
        leader.event(EVENTS[2])
    joined = await here.share(the_key, stream=True, deadline=until)
    assert joined.role == "leader", "it waited for the end, then led the key's next flight"
    assert joined.leader is not None
    publish(joined.leader, EVENTS, ANSWER)


async def test_a_flights_round_trips_are_one_span_each_side_not_one_per_batch(
    redis_server: RedisServer, flights: Callable[..., SingleFlight]
) -> None:
    # The publisher made a span per batch (about one per token of a slow model: 40 of the 70
    # spans of a short answer's trace), and a replica's reader one per poll.
    provider, exporter = memory_tracing()
    traced = KeyValueStore.from_url(redis_server.url, provider.get_tracer("t"), timeout=10.0)
    try:
        here, there = flights(traced), flights(traced)
        the_key, until = key(), await deadline()
        with provider.get_tracer("t").start_as_current_span("request"):
            leader = await streamed_leader(here, the_key, until, EVENTS[:1])
        remote = await there.share(the_key, stream=True, deadline=until)
        reading = asyncio.create_task(drain(remote))
        for event in EVENTS[1:]:
            leader.event(event)
            await asyncio.sleep(0.05)  # a batch each
        leader.ended(ANSWER, None)
        assert await reading == EVENTS
        await no_reader_counted(traced, leader, here, there)
    finally:
        await traced.aclose()
    spans = exporter.get_finished_spans()
    names = [span.name for span in spans]
    assert "redis flight_publish" not in names and "redis flight_read" not in names, names
    (published,) = [span for span in spans if span.name == "flight publish"]
    (read,) = [span for span in spans if span.name == "flight read"]
    attributes = published.attributes or {}
    assert attributes[attr.FLIGHT_ROUND_TRIPS] >= 2 and attributes[attr.FLIGHT_EVENTS] == 6
    assert (read.attributes or {})[attr.FLIGHT_EVENTS] == 6
    request = next(span for span in spans if span.name == "request")
    assert published.parent is not None and published.parent.span_id == request.context.span_id


async def test_a_request_that_comes_while_the_leaders_model_call_closes_leads_anew(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    # The leader's client leaves and nobody follows: its response is cancelled, and the
    # cancellation reaches the answer only after the model call's close, which awaits the
    # network. A request of the key joining meanwhile followed the answer so far, then ended
    # midway (a review's reproducer); the response now lets the answer go before it cancels.
    here = flights(kv)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=True, deadline=until)
    assert leading.leader is not None
    leading.leader.lead(still_shared=lambda: True, storable=lambda c: True)
    begun, closing, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def model() -> AsyncIterator[AnswerEvent]:
        try:
            for event in EVENTS[:2]:
                yield event
            begun.set()
            await asyncio.sleep(60)
        finally:
            closing.set()
            with anyio.CancelScope(shield=True):  # as httpcore's close of its connection
                await closed.wait()

    answer = AnswerStream(model(), lambda: ANSWER)
    answer.tap(leading.leader)

    async def body() -> AsyncIterator[bytes]:
        async with aclosing(answer.events()) as events:
            async for _ in events:
                yield b"data: {}\n\n"

    response = EventStreamResponse(body(), deadline=until, write_stall_s=5, shared=answer)
    gone = asyncio.Event()

    async def receive() -> dict[str, str]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        pass

    served = asyncio.create_task(response({"type": "http"}, receive, send))
    await asyncio.wait_for(begun.wait(), 5)
    gone.set()  # the leader's client leaves; nobody follows
    await asyncio.wait_for(closing.wait(), 5)  # the model call is being closed
    joining = asyncio.create_task(here.share(the_key, stream=True, deadline=until))
    await asyncio.sleep(0.1)
    closed.set()
    joined = await joining
    await asyncio.wait_for(served, 5)
    assert joined.role == "leader", "it waited for the end, then led the key's next flight"
    assert joined.leader is not None
    publish(joined.leader, EVENTS, ANSWER)


async def test_a_replicas_reader_stays_counted_while_it_reads_a_stream_longer_than_its_ttl(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    # The count expired a stream's TTL after the reader began, so a leader whose client left
    # then stopped the answer under a remote follower still reading it; and the reader's
    # leaving then set it to -1. Each reader now lives a lock's TTL unless it reads again.
    here = flights(kv, stream_ttl_ms=600, lock_ttl_ms=1500)
    there = flights(kv, stream_ttl_ms=600, lock_ttl_ms=1500)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:1])
    remote = await there.share(the_key, stream=True, deadline=until)
    assert remote.events is not None
    assert await anext(remote.events) == EVENTS[0]
    for _ in range(12):  # 1.2 s of an answer, twice the count's TTL
        leader.event(ContentDelta("more"))
        assert await anext(remote.events) == ContentDelta("more")
        await asyncio.sleep(0.1)
    assert await leader.followed(), "the remote reader was forgotten"
    await remote.events.aclose()
    await no_reader_counted(kv, leader, there)


async def test_a_replica_that_dies_while_it_reads_is_not_counted_once_its_ttl_has_passed(
    redis_server: RedisServer, kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    # A replica killed while it reads a flight never counts its reader out. The count was one
    # number for all the replicas, kept alive by any that still read and then for a minute:
    # a leader whose client left read on all that time for nobody.
    with FaultProxy(redis_server.url) as proxy:
        cut_off = KeyValueStore.from_url(proxy.url, TRACER, timeout=0.5)
        try:
            # The doomed reader lives a second unless it counts in again; the living one 5 s,
            # so a slow turn of a busy machine does not drop it.
            here, doomed = flights(kv, lock_ttl_ms=1000), flights(cut_off, lock_ttl_ms=1000)
            alive = flights(kv, lock_ttl_ms=5000)
            the_key, until = key(), await deadline()
            leader = await streamed_leader(here, the_key, until, EVENTS[:1])
            dying = await doomed.share(the_key, stream=True, deadline=until)
            living = await alive.share(the_key, stream=True, deadline=until)
            assert dying.events is not None and living.events is not None
            assert await anext(living.events) == EVENTS[0]
            proxy.pause()  # the doomed replica can no longer reach Redis: as if killed
            for _ in range(15):  # 1.5 s of the answer: the doomed reader's TTL has passed
                leader.event(ContentDelta("more"))
                assert await anext(living.events) == ContentDelta("more")
                await asyncio.sleep(0.1)
            assert await leader.followed(), "the replica still alive reads it"
            await living.events.aclose()  # its reader counts itself out
            for _ in range(100):
                if not await leader.followed():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a dead replica's reader is still counted after 5 s")
            await dying.events.aclose()
        finally:
            proxy.resume()
            await cut_off.aclose()


# Found by a review of the readers' set (2026-12-06, sixth session), each reproduced first.


async def test_a_replica_whose_reader_cannot_count_itself_in_relays_nothing(
    redis_server: RedisServer, kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    # The reader's first count-in was refused once (StoreBusy: this process's commands
    # backlogged, Redis fine) and never tried again, yet it read the stream: the leader, its
    # client gone, saw no reader and stopped, and the follower was cut off after 6 events.
    # Now the count-in goes with the read: a read that cannot count the reader in is not made.
    busy = KeyValueStore.from_url(redis_server.url, TRACER, timeout=10.0)
    real, refused = busy.pipeline, []

    async def first_refused(name: str, queue: Any, **options: bool) -> list[Any]:
        if not refused:
            refused.append(name)
            raise StoreBusy("all connections busy", retry_after_s=1.0)
        return await real(name, queue, **options)

    busy.pipeline = first_refused  # type: ignore[method-assign]
    try:
        here, there = flights(kv), flights(busy)
        the_key, until = key(), await deadline()
        leader = await streamed_leader(here, the_key, until, EVENTS[:1])
        remote = await there.share(the_key, stream=True, deadline=until)
        assert refused, "the replica's first round trip for the flight was refused"
        assert remote.role == "off", "it generates alone rather than follow uncounted"
        assert not await leader.followed()
    finally:
        await busy.aclose()


@pytest.mark.parametrize("redis", ["busy", "down"])
async def test_a_leader_whose_question_is_refused_reads_on_unless_redis_is_down(
    redis_server: RedisServer, kv: KeyValueStore, flights: Callable[..., SingleFlight], redis: str
) -> None:
    # The stop script refused while Redis is up (StoreBusy) was taken for "no replica reads
    # it": the flight ended there and a counted remote follower was cut off after 4 events.
    # Now it is read on and asked again at the next check; with Redis down (the circuit
    # open) no replica can read it, and it stops as before.
    asking = KeyValueStore.from_url(redis_server.url, TRACER, timeout=10.0)
    real = asking.run_script

    async def refused(name: str, script: Any, keys: Any, args: Any) -> Any:
        if name != "flight_stop":
            return await real(name, script, keys, args)
        if redis == "down":
            asking._down_until = time.monotonic() + 30  # as after connections failed
            raise StoreUnavailable("circuit open", retry_after_s=30)
        raise StoreBusy("all connections busy", retry_after_s=1.0)

    try:
        here, there = flights(asking), flights(kv)
        the_key, until = key(), await deadline()
        leader = await streamed_leader(here, the_key, until, EVENTS[:1])
        remote = await there.share(the_key, stream=True, deadline=until)
        assert remote.events is not None and await anext(remote.events) == EVENTS[0]
        asking.run_script = refused  # type: ignore[method-assign]
        if redis == "down":
            assert not await leader.followed()
            await remote.events.aclose()
            return
        assert await leader.followed(), "a replica may read it: read on, ask again later"
        asking.run_script = real  # type: ignore[method-assign]
        reading = asyncio.create_task(drain(remote))
        publish(leader, EVENTS[1:], ANSWER)
        assert await reading == EVENTS[1:]
    finally:
        asking._down_until = 0.0
        await asking.aclose()


async def command_calls(kv: KeyValueStore) -> dict[str, int]:
    """How often the test Redis ran each command since its stats were reset."""
    stats = await kv.client.info("commandstats")
    return {name.removeprefix("cmdstat_"): entry["calls"] for name, entry in stats.items()}


async def test_an_idle_replicas_reader_counts_itself_in_every_third_of_its_ttl_not_every_poll(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    # A script in a pipeline makes redis-py ask Redis whether it has the script (SCRIPT
    # EXISTS), a round trip of its own: counting in with every poll (every 100 ms of a silent
    # leader, each flight, each replica) doubled the reader's round trips.
    here, there = flights(kv, lock_ttl_ms=3000), flights(kv, lock_ttl_ms=3000)
    the_key, until = key(), await deadline()
    leader = await streamed_leader(here, the_key, until, EVENTS[:1])
    remote = await there.share(the_key, stream=True, deadline=until)
    assert remote.events is not None and await anext(remote.events) == EVENTS[0]
    await kv.client.config_resetstat()
    started, calls = time.monotonic(), {}
    for _ in range(300):  # the leader silent: until the reader has polled 10 times
        await asyncio.sleep(0.1)
        calls = await command_calls(kv)
        if calls.get("xread", 0) >= 10:
            break
    elapsed = time.monotonic() - started
    assert calls.get("xread", 0) >= 10, calls
    # Counted in once a second (a third of its 3 s TTL) however often it polls.
    assert calls.get("zadd", 0) <= elapsed + 1, (elapsed, calls)
    assert calls.get("script|exists", 0) <= elapsed + 1, (elapsed, calls)
    leader.ended(ANSWER, None)
    await remote.events.aclose()


async def test_a_leaders_batches_renew_its_lock_every_third_of_its_ttl_not_each_batch(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    # The same for the publisher: each batch (about one a token of the CPU model) renewed the
    # lock by a script, a SCRIPT EXISTS round trip before each batch's own.
    here = flights(kv, lock_ttl_ms=3000)
    the_key, until = key(), await deadline()
    await kv.client.config_resetstat()
    started = time.monotonic()
    leader = await streamed_leader(here, the_key, until, EVENTS[:1])
    for _ in range(20):
        leader.event(ContentDelta("more"))
        await asyncio.sleep(0.03)  # a batch each, as the machine allows
    leader.ended(ANSWER, None)
    await settled(lambda: not here._flights)
    elapsed, calls = time.monotonic() - started, await command_calls(kv)
    assert calls.get("xadd", 0) >= 5, calls
    # Renewed once a second (a third of its 3 s TTL), and released once: not with each batch.
    assert calls.get("script|exists", 0) <= elapsed + 2, (elapsed, calls)
    held = await on_redis(kv, leader, 2)
    assert held[-1].kind == "done" and await kv.get(here.lock_key(the_key)) is None


async def test_the_leaders_error_reaches_its_followers_as_the_same_error(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    waiting = [
        asyncio.create_task(replica.share(the_key, stream=False, deadline=until))
        for replica in (here, there)
    ]
    await settled(lambda: following(the_key, here, there) == 2)
    error = ContextTooLong("This model's maximum context length is 2048 tokens.")
    leading.leader.ended(None, error)
    for task in waiting:
        shared = await task
        assert shared.role == "follower" and isinstance(shared.error, ContextTooLong)
        assert shared.error.to_dict() == error.to_dict()


async def test_an_answer_the_cache_would_not_store_is_not_shared_with_plain_followers(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    here = flights(kv)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    follower = asyncio.create_task(here.share(the_key, stream=False, deadline=until))
    await settled(lambda: following(the_key, here) == 1)
    filtered = Completion(content="", finish_reason="content_filter", model="smollm2")
    publish(leading.leader, [Finish("content_filter")], filtered)
    shared = await follower
    assert shared.role == "off" and shared.completion is None  # it generates alone


async def test_a_leader_that_dies_without_a_word_is_taken_over_once_its_lock_expires(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    dead, alive = flights(kv, lock_ttl_ms=600), flights(kv, lock_ttl_ms=600)
    the_key, until = key(), await deadline()
    # A replica killed mid-generation: its lock stays until it expires, and its stream is empty.
    await kv.set(dead.lock_key(the_key), b"token-of-a-dead-replica")
    await kv.client.pexpire(dead.lock_key(the_key), 600)
    joined: list[Shared] = []
    requests = [asyncio.create_task(request(alive, the_key, joined, until)) for _ in range(5)]
    await settled(lambda: bool(joined))
    assert [shared.role for shared in joined] == ["leader"]
    assert joined[0].leader is not None
    publish(joined[0].leader, EVENTS, ANSWER)
    await settled(lambda: len(joined) == 5)
    assert [shared.completion for shared in joined[1:]] == [ANSWER] * 4
    for task in requests:
        task.cancel()


async def test_a_follower_waits_no_longer_than_its_deadline(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    here = flights(kv)
    the_key = key()
    leading = await here.share(the_key, stream=False, deadline=await deadline())
    assert leading.role == "leader"
    with pytest.raises(DeadlineExceeded):
        await here.share(the_key, stream=False, deadline=await deadline(0.3))


@pytest.mark.parametrize(
    "why",
    [asyncio.CancelledError, ClientClosedRequest],
    ids=["its request cancelled", "its client left the slot's queue"],
)
async def test_a_leader_that_lets_go_before_its_answer_hands_the_flight_over(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
    why: type[BaseException],
) -> None:
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    follower = asyncio.create_task(there.share(the_key, stream=False, deadline=until))
    await settled(lambda: following(the_key, there) == 1)  # it follows before the leader goes
    leading.leader.ended(None, why())  # not the follower's failure: it is not passed on
    taken = await follower
    assert taken.role == "leader"  # joined again and took the lock: it generates


async def test_a_degraded_request_follows_its_keys_flight_under_way_in_its_process(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    """Made with defaults (a ``variant``), it may follow the answer made without them: the
    answer the cache would serve it a moment later."""
    here = flights(kv)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    degraded = asyncio.create_task(
        here.share(the_key, stream=False, deadline=until, variant="features")
    )
    await settled(lambda: following(the_key, here) == 1)
    publish(leading.leader, EVENTS, ANSWER)
    shared = await degraded
    assert (shared.role, shared.completion) == ("follower", ANSWER)
    assert shared.detail == "followed an answer made without defaults"


async def test_a_degraded_request_follows_its_keys_flight_led_on_another_replica(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    """The key's lock is held on another replica: a request made with defaults reads that
    leader's answer (streamed, from its first event) rather than generate its own."""
    here, there = flights(kv), flights(kv)
    the_key, until = key(), await deadline()
    leading = await there.share(the_key, stream=True, deadline=until)
    assert leading.leader is not None
    degraded = [
        asyncio.create_task(here.share(the_key, stream=stream, deadline=until, variant="features"))
        for stream in (True, False)
    ]
    await settled(lambda: following(the_key, here) == 2)
    assert await kv.get(here.lock_key(f"{the_key}~features")) is None  # no flight of its own
    publish(leading.leader, EVENTS, ANSWER)
    streamed, plain = await asyncio.gather(*degraded)
    assert streamed.role == "follower" and await drain(streamed) == EVENTS
    assert (plain.role, plain.completion) == ("follower", ANSWER)
    assert {streamed.detail, plain.detail} == {"followed an answer made without defaults"}


async def test_degraded_requests_share_only_with_requests_degraded_alike(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
) -> None:
    here, there = flights(kv), flights(kv)
    the_key, until, joined = key(), await deadline(), []
    tasks = [asyncio.create_task(request(here, the_key, joined, until, variant="features"))]
    await settled(lambda: len(joined) == 1)  # no flight of the key: it leads its variant's
    tasks += [
        asyncio.create_task(request(r, the_key, joined, until, variant="features"))
        for r in (here, there)
    ]
    await settled(lambda: following(f"{the_key}~features", here, there) == 2)
    # Degraded in other stages, and not degraded: neither follows the flight above. (One after
    # the other: a degraded request follows its key's own flight once one is under way.)
    for variant in ("features,route", ""):
        tasks.append(asyncio.create_task(request(here, the_key, joined, until, variant=variant)))
        await settled(lambda: len(joined) == len(tasks) - 2)
    assert [shared.role for shared in joined] == ["leader"] * 3
    led = [shared.leader.flight.key for shared in joined if shared.leader is not None]
    assert sorted(led) == sorted([f"{the_key}~features", f"{the_key}~features,route", the_key])
    assert joined[0].leader is not None
    publish(joined[0].leader, EVENTS, ANSWER)
    await settled(lambda: len(joined) == 5)
    assert [(shared.role, shared.completion) for shared in joined[3:]] == [("follower", ANSWER)] * 2
    for task in tasks:
        task.cancel()


@pytest.mark.parametrize("leader", ["here", "on another replica"])
async def test_a_degraded_request_never_takes_over_its_keys_flight(
    kv: KeyValueStore,
    flights: Callable[..., SingleFlight],
    leader: str,
) -> None:
    """Its leader (in this process or on another replica) let go: a request made with defaults
    leads its variant's flight, and leaves the key's own to a request made without them."""
    here = flights(kv)
    there = here if leader == "here" else flights(kv)
    the_key, until, joined = key(), await deadline(), []
    leading = await there.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    task = asyncio.create_task(request(here, the_key, joined, until, variant="route"))
    await settled(lambda: following(the_key, here) == 1)
    leading.leader.ended(None, asyncio.CancelledError())
    await settled(lambda: len(joined) == 1)
    taken = joined[0]
    assert taken.role == "leader" and taken.leader is not None
    assert taken.leader.flight.key == f"{the_key}~route"
    assert await kv.get(here.lock_key(f"{the_key}~route")) is not None
    for _ in range(100):  # the let-go flight's lock is released, and nobody took it
        if await kv.get(here.lock_key(the_key)) is None:
            break
        await asyncio.sleep(0.05)
    assert await kv.get(here.lock_key(the_key)) is None
    task.cancel()


@pytest.mark.parametrize("variant", ["", "features"])
async def test_redis_down_turns_coalescing_off(
    flights: Callable[..., SingleFlight], variant: str
) -> None:
    """Made with defaults or not: a degraded request cannot learn whether another replica
    leads its key either, and generates alone."""
    down = KeyValueStore.from_url(f"redis://127.0.0.1:{free_port()}/0", TRACER, timeout=0.2)
    try:
        shared = await flights(down).share(
            key(), stream=False, deadline=await deadline(), variant=variant
        )
    finally:
        await down.aclose()
    assert shared.role == "off" and "store" in shared.detail
    with pytest.raises(StoreUnavailable):  # the store itself is down, as it says
        await down.get("anything")


@pytest.mark.parametrize("variant", ["", "features"])
async def test_a_flight_whose_lock_release_failed_holds_up_no_later_request_here(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], variant: str
) -> None:
    """Redis failed at the leader's last publish: the key's lock keeps this process's token
    until it expires. A later request of the key here does not wait for that (for the ended
    flight's stream, which will never end): made without defaults, it takes the lock over and
    leads; made with them, it leads its variant's flight."""
    here = flights(kv, lock_ttl_ms=30_000)
    the_key, until = key(), await deadline()
    leading = await here.share(the_key, stream=False, deadline=until)
    assert leading.leader is not None
    real = kv.pipeline

    async def failing(name: str, queue: Callable[..., object], **options: object) -> object:
        if name == "flight_publish":  # a fault the real Redis cannot be timed to make
            raise StoreUnavailable("connection reset")
        return await real(name, queue, **options)  # type: ignore[arg-type]

    kv.pipeline = failing  # type: ignore[method-assign]
    try:
        publish(leading.leader, EVENTS, ANSWER)
        await settled(lambda: the_key not in here._flights)
    finally:
        kv.pipeline = real  # type: ignore[method-assign]
    lock = here.lock_key(the_key)
    assert await kv.get(lock) == leading.leader.flight.token.encode()  # still held
    shared = await asyncio.wait_for(
        here.share(the_key, stream=False, deadline=until, variant=variant), 5
    )
    assert shared.role == "leader" and shared.leader is not None
    assert shared.leader.flight.key == (f"{the_key}~{variant}" if variant else the_key)
    if not variant:
        assert await kv.get(lock) == shared.leader.flight.token.encode()


async def test_degraded_requests_joining_their_variants_flight_here_ask_no_other_replica(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    """Only the first of a burst of degraded requests reads the key's lock: the others join
    the flight of their variant it leads (one Redis read, not one per request, when a slow
    Redis is what made them degrade)."""
    here = flights(kv)
    the_key, until, joined = key(), await deadline(), []
    reads: list[str] = []
    real = kv.get

    async def get(name: str) -> bytes | None:
        reads.append(name)
        return await real(name)

    kv.get = get  # type: ignore[method-assign]
    try:
        tasks = [asyncio.create_task(request(here, the_key, joined, until, variant="route"))]
        await settled(lambda: len(joined) == 1)
        tasks += [
            asyncio.create_task(request(here, the_key, joined, until, variant="route"))
            for _ in range(4)
        ]
        await settled(lambda: following(f"{the_key}~route", here) == 4)
    finally:
        kv.get = real  # type: ignore[method-assign]
    assert reads == [here.lock_key(the_key)]
    for task in tasks:
        task.cancel()


# Found by a hostile review (2026-12-05): what another replica (another version, or no flight's
# at all) can leave on Redis, and a lock script whose reply never came back.


@pytest.mark.parametrize("variant", ["", "features"])
async def test_a_lock_value_that_is_not_text_is_another_replicas_flight_and_never_an_error(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], variant: str
) -> None:
    """A lock holding bytes that are not UTF-8 was a UnicodeDecodeError (a 500), and left the
    key's flight here marked as another replica's with no reader: every later request of the
    key waited for its deadline. Now it is a flight with an empty stream, followed until the
    lock goes; then the request leads."""
    here = flights(kv, lock_ttl_ms=1_000)
    the_key = key()
    await kv.client.set(here.lock_key(the_key), b"\xff\xfe not a token", px=300)
    async with asyncio.timeout(5):  # in this task: a leader's flight ends with its task
        shared = await here.share(the_key, stream=False, deadline=await deadline(), variant=variant)
    assert shared.role == "leader", shared  # once the lock had gone


async def lock_script_reply_lost(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], cut: str
) -> tuple[SingleFlight, SingleFlight, str]:
    """Two replicas; the first's first request of a key runs the lock script on Redis, which
    takes the lock, but its reply is lost (``cut`` "store": a Redis timeout) or the request
    is gone before it comes (``cut`` "deadline")."""
    here, there = flights(kv, lock_ttl_ms=30_000), flights(kv, lock_ttl_ms=30_000)
    the_key = key()
    real = kv.run_script

    async def lossy(name: str, *args: object) -> object:
        result = await real(name, *args)  # type: ignore[arg-type]
        if name == "flight_acquire" and await kv.get(here.lock_key(the_key)) is not None:
            kv.run_script = real  # type: ignore[method-assign]
            if cut == "store":  # a fault the real Redis cannot be timed to make
                raise StoreUnavailable("redis EVALSHA flight_acquire: TimeoutError")
            await asyncio.sleep(30)  # the reply is slow to come back
        return result

    kv.run_script = lossy  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    try:
        if cut == "store":
            shared = await here.share(the_key, stream=False, deadline=loop.time() + 20)
            assert shared.role == "off" and "store" in shared.detail
        else:
            with pytest.raises(DeadlineExceeded):
                await here.share(the_key, stream=False, deadline=loop.time() + 0.5)
    finally:
        kv.run_script = real  # type: ignore[method-assign]
    return here, there, the_key


@pytest.mark.parametrize("cut", ["store", "deadline"])
async def test_a_lock_taken_by_a_script_whose_reply_was_lost_holds_up_no_later_request(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], cut: str
) -> None:
    """The lock was left for a flight nobody leads: later requests of the key followed its
    empty stream until the lock expired (30 s here), or failed at their deadline. Now this
    replica takes its own lock over and leads, and another replica's request follows it."""
    here, there, the_key = await lock_script_reply_lost(kv, flights, cut)
    async with asyncio.timeout(5):  # in this task: a leader's flight ends with its task
        shared = await here.share(the_key, stream=False, deadline=await deadline())
    assert shared.role == "leader" and shared.leader is not None
    joined: list[Shared] = []
    follower = asyncio.create_task(request(there, the_key, joined, await deadline()))
    await settled(lambda: following(the_key, there) == 1)
    publish(shared.leader, EVENTS, ANSWER)
    await asyncio.wait_for(follower, 5)
    assert joined[0].role == "follower" and joined[0].completion == ANSWER


async def test_another_replicas_request_leads_at_once_when_the_script_reply_was_lost(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    """The flight is ended on Redis for the other replicas too (its stream's last entry
    "gone", the lock released): a request there leads, long before the lock (30 s) would
    have expired."""
    _, there, the_key = await lock_script_reply_lost(kv, flights, "store")
    async with asyncio.timeout(10):
        shared = await there.share(the_key, stream=False, deadline=await deadline())
    assert shared.role == "leader", shared


async def remote_flight(kv: KeyValueStore, here: SingleFlight, *fields: dict[str, object]) -> str:
    """A key whose lock another replica holds, its stream holding ``fields`` entries."""
    the_key, token = key(), uuid.uuid4().hex
    await kv.client.set(here.lock_key(the_key), token, px=30_000)
    for entry in fields:
        await kv.client.xadd(here.stream_key(the_key, token), entry)  # type: ignore[arg-type]
    return the_key


async def test_a_stream_entry_without_a_flights_field_is_stepped_over_not_read_again(
    kv: KeyValueStore, flights: Callable[..., SingleFlight]
) -> None:
    """The reader kept its position before such an entry, so each XREAD returned it at once:
    5,041 reads in a second where the poll is 100 ms. Now it reads past it, and the next
    entry, the leader's answer, reaches the follower."""
    here = flights(kv, poll_ms=100)
    done = entry_wire(Entry("done", completion=ANSWER, shared=True))
    the_key = await remote_flight(kv, here, {"junk": "1"})
    reads = 0
    real = kv.pipeline

    async def counting(name: str, queue: Callable[..., object], **options: object) -> object:
        nonlocal reads
        reads += name == "flight_read"
        return await real(name, queue, **options)  # type: ignore[arg-type]

    kv.pipeline = counting  # type: ignore[method-assign]
    try:
        task = asyncio.create_task(here.share(the_key, stream=False, deadline=await deadline()))
        await asyncio.sleep(1.0)
        assert reads <= 20, f"{reads} stream reads in a second with a 100 ms poll"
        lock = await kv.get(here.lock_key(the_key))
        assert lock is not None
        await kv.client.xadd(here.stream_key(the_key, lock.decode()), {"e": done})
        shared = await asyncio.wait_for(task, 5)
    finally:
        kv.pipeline = real  # type: ignore[method-assign]
    assert shared.role == "follower" and shared.completion == ANSWER


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[1, 2]", b'{"k": "events", "e": [["c"]]}', b'{"c": {"content": 1}}'],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_entry_this_code_cannot_read_sends_its_followers_on_alone(
    kv: KeyValueStore, flights: Callable[..., SingleFlight], raw: bytes, stream: bool
) -> None:
    """Another version's entry (or no flight's): the reader task died on it, and its followers
    joined again and again; now they go on without sharing ("off"), plain or streamed."""
    here = flights(kv)
    the_key = await remote_flight(kv, here, {"e": raw})
    async with asyncio.timeout(5):
        shared = await here.share(the_key, stream=stream, deadline=await deadline())
    assert shared.role == "off" and "cannot be read" in shared.detail
    with pytest.raises(MalformedEntry):
        entry_from_wire(raw)


def test_a_leaders_error_with_headers_that_are_not_text_loses_them_not_the_answer() -> None:
    """A follower's error response writes the leader's headers: an int there was a 500."""
    raw = orjson.dumps(
        {
            "k": "failed",
            "x": {
                "class": "UpstreamBusy",
                "message": "busy",
                "code": 7,
                "headers": {"Retry-After": 5, "X-Ok": "yes", "7": ["a"]},
                "extra": {"route": "small", "nested": {"a": 1}},
            },
        }
    )
    error = entry_from_wire(raw).error
    assert isinstance(error, UpstreamBusy)
    assert error.headers == {"X-Ok": "yes"} and error.code is None
    assert error.route == "small" and not hasattr(error, "nested")
    JSONResponse(error.to_dict(), status_code=error.status_code, headers=error.headers)
