"""Request coalescing (single flight): identical concurrent misses share one generation, across
replicas, through Redis.

A flight is one cache key's generation. The first request to reach generation with the key
takes a short lock (``SET NX PX`` in a script, with a token; renewed while it generates; only
its owner's token releases it) and leads: what its reader gets from the answer stream (after
the output filters, with the citations: ``pipeline.answer.stream.StreamTap``) is appended to a
Redis stream named for the lock's token, in batches (``XADD`` with ``MAXLEN``; the stream
expires). The last entry says how the flight ended: ``done`` (the completion, and whether the
cache would store it), ``failed`` (the leader's error, OpenAI-shaped), ``gone`` (the leader let
go without an answer: its caller left, or it failed outside the model call) or ``unshared`` (it
stopped sharing midway: a search of the generation loop saw another index version than the key
holds). Followers read the stream from its first entry (``XREAD BLOCK``), on any replica.

In one process, the requests of one key share one flight object: its entries are kept in
memory, so a local leader's followers read them at once, and a remote leader's are read from
Redis by one task per flight, not one per request.

A request made after a degraded stage (``pipeline.stages.cache.degraded``: its answer is made
with defaults, and the cache will not keep it) shares through the flight of its key and its
*variant*, the stages that degraded, so only with requests degraded alike; before that it
follows its key's own flight if one is under way, in this process or on another replica (the
answer the cache would serve it a moment later). It never leads its key's own flight.

A follower that has sent nothing to its caller yet recovers from a leader that let go: it joins
again (one of them takes the lock over and leads); from a leader that died without a word (a
replica killed) the same way once the lock has expired (followers check it while the stream is
idle). A streamed leader whose client leaves while others follow it (here, or on a replica
whose reader of its stream counts itself in ``{stream}:reading``) finishes the answer for them
(``Leader.followed``, ``app.http.streaming``); one nobody follows stops at once (asked and
ended on Redis in one script, so a replica cannot join in between). A streamed
follower that has sent part of the answer cannot start again (a leader that stopped anyway:
its deadline, a failure): it ends with an error. Redis trouble turns coalescing off (the
request generates alone), never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

from opentelemetry.trace import Span

from pipeline.answer.completion import Completion
from pipeline.answer.events import AnswerEvent
from pipeline.errors import (
    ClientClosedRequest,
    DeadlineExceeded,
    PipelineError,
    ServiceUnavailable,
    StoreUnavailable,
)
from pipeline.store.flight_entries import Entry, MalformedEntry, entry_from_wire, entry_wire
from pipeline.store.kv import KeyValueStore, ScriptArg
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import current_span

Role = Literal["leader", "follower", "off"]

# Returns the token holding the lock, or nil when this call took it. ARGV[3], when given, is
# this process's own token from a flight whose release it could not confirm: taken over.
ACQUIRE: Final = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[3] then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# A leader whose reader left asks whether another replica reads its stream, and if none does,
# ends the flight there in the same step: a replica that counts its reader in afterwards finds
# the stream holding only that end (trimmed to it: what it held before is for nobody), so its
# requests join again rather than relay part of an answer that stops. Asked in two steps (the
# count, then the end), a replica joining in between was cut off midway.
# KEYS: the readers (READING), the stream, the lock. ARGV: the token, the end's entry, the stream's
# TTL in ms. Returns 1 when read there (nothing changed), 0 when ended.
STOP_UNLESS_READ: Final = """
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now[1] * 1000 + math.floor(now[2] / 1000))
if redis.call('ZCARD', KEYS[1]) > 0 then return 1 end
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'e', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
return 0
"""
# A replica's reader of a flight's stream counts itself in with its first read, and again every
# third of its TTL: a sorted set of the readers, each scored by when it is taken for dead unless
# it counts in again (Redis's clock, so the replicas' own clocks do not matter). A replica that
# dies while it reads is no longer counted a TTL later, whoever else still reads (a count it
# could not take itself out of stayed up while another replica read, then a minute).
# KEYS: the flight's readers. ARGV: this reader, its TTL in ms.
READING: Final = """
local now = redis.call('TIME')
local expiry = now[1] * 1000 + math.floor(now[2] / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


# --- the flight as this process sees it ---


class Flight:
    """One key's entries so far, in order, for every request of this process that follows it."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.entries: list[Entry] = []
        self.ended = False
        self.role: Literal["pending", "leader", "remote", "off"] = "pending"
        self.detail = ""
        self.decided = asyncio.Event()
        self.readers = 0
        # Its leader has stopped (gone, or unshared): its last entry is on its way (after
        # Redis has it), and nobody can follow it to an answer.
        self.abandoned = False
        self._wake = asyncio.Event()

    def decide(self, role: Literal["leader", "remote", "off"], detail: str = "") -> None:
        self.role, self.detail = role, detail
        self.decided.set()

    def append(self, entry: Entry) -> None:
        if self.ended:
            return
        self.entries.append(entry)
        self.ended = entry.terminal
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def read(self, start: int = 0) -> AsyncIterator[Entry]:
        """The entries from ``start`` on, waiting for those still to come, to the terminal."""
        position = start
        while True:
            while position < len(self.entries):
                yield self.entries[position]
                position += 1
            if self.ended:
                return
            await self._wake.wait()


@dataclass
class Shared:
    """What joining a flight gave: lead (``leader``), the leader's answer (``completion`` for a
    plain request; ``answer`` events for a streamed one, the first already there), the
    leader's ``error``, or nothing to share (``off``, and why: the request generates alone)."""

    role: Role
    leader: Leader | None = None
    completion: Completion | None = None
    events: AsyncIterator[AnswerEvent] | None = None
    final: Callable[[], Completion] | None = None
    error: PipelineError | None = None
    detail: str = ""


Cached = Callable[[str], Awaitable[Completion | None]]


class SingleFlight:
    """This process's flights, and the Redis lock and stream each one is shared through.

    ``lock_ttl_ms``: how long a silent leader keeps its followers waiting (renewed every
    third of it while it generates); ``poll_ms``: the longest one ``XREAD BLOCK`` waits (keep
    it well under the Redis client's socket timeout); ``cached``: the cache lookup a new leader
    makes once more (a flight that just ended has stored its answer there);
    ``joins``: how often a request joins again after its leader let go, before it generates
    alone."""

    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:flight:",
        cached: Cached | None = None,
        lock_ttl_ms: int = 5000,
        poll_ms: int = 100,
        stream_ttl_ms: int = 60_000,
        max_entries: int = 10_000,
        joins: int = 4,
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.cached = cached
        self.lock_ttl_ms = lock_ttl_ms
        self.poll_ms = poll_ms
        self.stream_ttl_ms = stream_ttl_ms
        self.max_entries = max_entries
        self.joins = joins
        self._flights: dict[str, _Led] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # By key: the token of a flight of this process that ended without its lock's release
        # confirmed (Redis failed at its last publish), and until when that lock may last.
        # Neither a leader nor a follower of this key waits on it.
        self._unreleased: dict[str, tuple[str, float]] = {}
        self._acquire = kv.script(ACQUIRE)
        self.renew_script = kv.script(RENEW)
        self.release_script = kv.script(RELEASE)
        self.reading_script = kv.script(READING)
        self.stop_script = kv.script(STOP_UNLESS_READ)

    def lock_key(self, key: str) -> str:
        # On a cluster a flight's lock, stream and readers are one slot (its scripts and
        # pipelines use them together), the flight's own.
        return f"{self.prefix}{self.kv.tag(key)}"

    def stream_key(self, key: str, token: str) -> str:
        return f"{self.lock_key(key)}:{token}"

    def readers_key(self, key: str, token: str) -> str:
        """The replicas that read the stream of the flight (each one's reader, once). Not
        ``:readers``, the count an earlier version kept there: a key of another type would
        refuse either version's commands."""
        return f"{self.stream_key(key, token)}:reading"

    async def share(self, key: str, *, stream: bool, deadline: float, variant: str = "") -> Shared:
        """Lead the key's flight, or follow it to the leader's answer (see ``Shared``).

        A ``variant`` (a request made with defaults: the stages that degraded on it) first
        follows the key's own flight where one is under way (here or on another replica), and
        never leads it; otherwise it leads or follows the flight of its variant, shared only
        with requests of the same key and variant."""
        try:
            async with asyncio.timeout_at(deadline):
                if variant:
                    variant_key = f"{key}~{variant}"
                    followed = await self._follow_under_way(
                        key, variant_key, stream=stream, deadline=deadline
                    )
                    if followed is not None:
                        return followed
                    return await self._share(variant_key, key, stream=stream, deadline=deadline)
                return await self._share(key, key, stream=stream, deadline=deadline)
        except TimeoutError as exc:
            raise DeadlineExceeded() from exc

    async def _share(self, key: str, cached: str, *, stream: bool, deadline: float) -> Shared:
        """Lead or follow the flight ``key``; a new leader looks ``cached`` up first."""
        for _ in range(self.joins):
            flight, first_here = await self._join(key)
            if flight.role == "off":
                return Shared("off", detail=flight.detail)
            if flight.role == "leader" and first_here:
                return await self._lead(flight, cached)
            shared = await self._read(flight, stream=stream, deadline=deadline)
            if shared is not None:
                return shared
        return Shared("off", detail="the flight's leaders kept letting go")

    async def _follow_under_way(
        self, key: str, variant_key: str, *, stream: bool, deadline: float
    ) -> Shared | None:
        """The leader's answer, when the key's flight is under way (in this process, or its
        lock is held on another replica) and it gives one; None otherwise (no flight, or its
        leader let go or could not share). Another replica is not asked while this process
        has the flight ``variant_key`` under way: the request joins that one."""
        flight = self._flights.get(key)
        if flight is None or flight.ended:
            variant = self._flights.get(variant_key)
            if variant is not None and not variant.ended:
                return None
            flight = await self._remote(key)
            if flight is None:
                return None
        await flight.decided.wait()
        if flight.role not in ("leader", "remote"):
            return None
        shared = await self._read(flight, stream=stream, deadline=deadline)
        if shared is None or shared.role != "follower":
            return None
        shared.detail = "followed an answer made without defaults"
        return shared

    async def _read(self, flight: Flight, *, stream: bool, deadline: float) -> Shared | None:
        """Follow ``flight``: its answer (a plain request's completion, a streamed one's
        events), its error, or nothing to share ("off"); None when its leader let go before
        its answer (join again)."""
        if flight.abandoned:
            # Following it would relay what it has and then fail midway (its leader's client
            # left a moment ago and nobody followed, or it stopped being shared): join again
            # once it has ended.
            async for _ in flight.read():
                pass
            return None
        flight.readers += 1
        entries = flight.read()
        try:
            entry = await anext(entries)
            while not stream and not entry.terminal:
                entry = await anext(entries)  # a plain request waits for the answer
        except BaseException:
            flight.readers -= 1
            raise
        if entry.kind == "events":  # streamed: the rest is read as the caller reads it
            return _follow(flight, entry, entries, deadline)
        flight.readers -= 1
        if entry.kind == "done" and entry.shared and entry.completion is not None:
            return Shared("follower", completion=entry.completion)
        if entry.kind == "failed" and entry.error is not None:
            return Shared("follower", error=entry.error)
        if entry.kind == "gone":
            return None
        return Shared("off", detail=entry.detail or entry.kind)  # unshared, not cacheable, ...

    async def _remote(self, key: str) -> _Led | None:
        """The key's flight when another replica leads it (its lock is held), read here as a
        follower's; or the one this process started meanwhile. None when no lock is held (or
        Redis cannot say): this call never takes the lock."""
        try:
            holder = await self.kv.get(self.lock_key(key))
        except StoreUnavailable:
            return None
        flight = self._flights.get(key)
        if flight is not None and not flight.ended:
            return flight  # joined here while the lock was read
        if holder is None or _text(holder) == self._unreleased_token(key):
            return None  # no flight, or one of this process's own that ended
        led = _Led(self, key, uuid.uuid4().hex)
        self._flights[key] = led
        self._read_from(led, holder)
        return led

    def _read_from(self, led: _Led, holder: object) -> None:
        """``led`` is another replica's flight, under the token ``holder``: one task of this
        process copies its stream, for every request here that follows it."""
        led.decide("remote")
        self._start(_read_remote(self, led, _text(holder)))

    def _unreleased_token(self, key: str) -> str | None:
        """This process's token still on the key's lock, as far as it knows (see
        ``_unreleased``); None once that lock has expired."""
        held = self._unreleased.get(key)
        if held is None:
            return None
        if held[1] <= time.monotonic():
            del self._unreleased[key]
            return None
        return held[0]

    def unreleased(self, key: str, token: str) -> None:
        """A flight of this process ended without its lock's release confirmed."""
        now = time.monotonic()
        for stale in [k for k, (_, until) in self._unreleased.items() if until <= now]:
            del self._unreleased[stale]
        self._unreleased[key] = (token, now + self.lock_ttl_ms / 1000.0)

    async def _join(self, key: str) -> tuple[_Led, bool]:
        """The key's flight in this process, and whether this call started it (and so leads
        it, if it took the lock)."""
        flight = self._flights.get(key)
        if flight is not None and not flight.ended:
            await flight.decided.wait()
            return flight, False
        token = uuid.uuid4().hex
        led = _Led(self, key, token)
        self._flights[key] = led
        own = self._unreleased_token(key)
        args: list[str | int] = [token, self.lock_ttl_ms]
        if own is not None:
            args.append(own)
        try:
            holder = await self.kv.run_script(
                "flight_acquire", self._acquire, [self.lock_key(key)], args
            )
        except StoreUnavailable as exc:
            self._abandon(key, token)
            led.decide("off", f"store: {exc.detail}")
            self.forget(led)
            return led, True
        except BaseException:
            self._abandon(key, token)
            led.decide("off", "the first request of the flight stopped")
            self.forget(led)
            raise
        if holder is None:
            self._unreleased.pop(key, None)
            led.decide("leader")
            return led, True
        self._read_from(led, holder)
        return led, True

    def _abandon(self, key: str, token: str) -> None:
        """The lock script was cut off (its reply lost, or its request gone): it may have run
        and locked the key for a flight nobody leads. This process takes such a lock over
        (``unreleased``); for the others, a task ends the flight on Redis as a leader that
        stopped would, its stream's last entry ``gone`` and the lock released (both only under
        this token: a no-op where the script had not locked the key)."""
        self.unreleased(key, token)
        gone = Entry("gone", detail="its leader stopped before it began")
        lock, stream = self.lock_key(key), self.stream_key(key, token)

        async def queue(pipe: Any) -> None:
            pipe.xadd(stream, {"e": entry_wire(gone)}, maxlen=1)
            pipe.pexpire(stream, min(self.stream_ttl_ms, 10_000))
            await self.release_script(keys=[lock], args=[token], client=pipe)

        async def end() -> None:
            with contextlib.suppress(StoreUnavailable):
                await self.kv.pipeline("flight_abandon", queue, transaction=True)

        self._start(end())

    async def _lead(self, flight: _Led, cached: str) -> Shared:
        """A new leader first looks in the cache once more (under ``cached``, the key's): a
        flight of the key that ended since this request's lookup has stored its answer there."""
        leader = Leader(flight)  # from here the flight ends however this request does
        hit: Completion | None = None
        if self.cached is not None:
            try:
                hit = await self.cached(cached)
            except StoreUnavailable:
                hit = None
        if hit is not None:
            leader.ended(hit, None)
            return Shared("follower", completion=hit, detail="cached")
        return Shared("leader", leader=leader)

    def _start(self, coroutine: Awaitable[None]) -> None:
        async def run() -> None:
            await coroutine

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop this process's publishers and readers (their flights end as gone)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def forget(self, flight: Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]


class _Led(Flight):
    """A flight this process joined first: it holds the token it locked with (a leader) or the
    leader's token it reads (a remote flight)."""

    def __init__(self, flights: SingleFlight, key: str, token: str) -> None:
        super().__init__(key)
        self.flights = flights
        self.token = token


def _follow(flight: Flight, first: Entry, entries: AsyncIterator[Entry], deadline: float) -> Shared:
    """A streamed follower's events, the first entry's first; each wait for the next entry
    ends at the request's deadline."""
    final: list[Completion] = []

    async def events() -> AsyncIterator[AnswerEvent]:
        try:
            entry = first
            while True:
                if entry.kind == "events":
                    for event in entry.events:
                        yield event
                elif entry.kind == "done" and entry.completion is not None:
                    final.append(entry.completion)
                    return
                elif entry.kind == "failed" and entry.error is not None:
                    raise entry.error
                else:  # part of the answer has gone out: it cannot start again
                    raise ServiceUnavailable(
                        "The shared generation of this answer stopped midway "
                        f"({entry.detail or entry.kind}); retry the request.",
                        code="coalesced_leader_gone",
                    )
                try:
                    async with asyncio.timeout_at(deadline):
                        entry = await anext(entries)
                except TimeoutError as exc:
                    raise DeadlineExceeded() from exc
        finally:
            flight.readers -= 1

    def completion() -> Completion:
        return final[0]

    return Shared("follower", events=events(), final=completion)


class Leader:
    """The request that generates: a ``StreamTap`` on its answer stream, publishing what its
    reader gets to this process's followers at once and to Redis in batches, renewing the lock
    while it does, and releasing it with the last entry.

    ``still_shared`` is asked before each event (a search of the generation loop may have seen
    another index version than the key's); ``storable`` of the completion (whether the cache
    would store it) decides whether followers may answer with it."""

    def __init__(self, flight: _Led) -> None:
        self.flight = flight
        self.flights = flight.flights
        self.still_shared: Callable[[], bool] = lambda: True
        self.storable: Callable[[Completion], bool] = lambda completion: True
        self._outbox: list[Entry] = []
        self._last: Entry | None = None
        # The flight was ended on Redis (``followed``): nothing more is sent there.
        self._ended_on_redis = False
        self._wake = asyncio.Event()
        self.flights._start(self._publish())
        # However the request ends (an error before its answer is read, a path that never
        # reads it), the flight ends with it: followers join again rather than wait.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._end(Entry("gone", detail="request ended")))

    def lead(
        self,
        *,
        still_shared: Callable[[], bool],
        storable: Callable[[Completion], bool],
    ) -> None:
        self.still_shared = still_shared
        self.storable = storable

    # StreamTap
    def event(self, event: AnswerEvent) -> None:
        if self._last is not None:
            return
        if not self.still_shared():
            self._end(Entry("unshared", detail="another index version was searched"))
            return
        entry = Entry("events", (event,))
        self.flight.append(entry)
        self._outbox.append(entry)
        self._wake.set()

    def ended(self, completion: Completion | None, error: BaseException | None) -> None:
        if completion is not None:
            shared = self.still_shared() and self.storable(completion)
            self._end(Entry("done", completion=completion, shared=shared))
        elif isinstance(error, PipelineError) and not isinstance(
            error, DeadlineExceeded | ClientClosedRequest
        ):
            # A follower's deadline is its own, and so is its client's leaving.
            self._end(Entry("failed", error=error))
        else:
            detail = "the leader's caller left" if error is None else type(error).__name__
            self._end(Entry("gone", detail=detail))

    async def followed(self) -> bool:
        """Whether requests follow this flight now: here, or on a replica that reads its
        stream. Asked when the leader's reader leaves; False ends the flight for followers
        (the caller stops the answer), and always once it has ended.

        Another replica is asked through Redis, and the flight is ended there in the same
        script when none reads it (``STOP_UNLESS_READ``); Redis failing, none can read it.
        This process's readers are counted again once Redis has answered: a request of the key
        may have joined here meanwhile (no Redis needed), and it would be cut off midway if the
        answer were stopped on the count read before. It is then read on for them alone."""
        if self._last is not None:
            return False
        if self.flight.readers > 0:
            return True
        if not self._ended_on_redis and await self._read_on_another_replica():
            return True
        if self._last is not None:
            return False
        if self.flight.readers > 0:
            return True
        self._end(Entry("gone", detail="the leader's caller left"))
        return False

    async def _read_on_another_replica(self) -> bool:
        """Whether a replica reads the flight's stream; the flight is ended on Redis if not."""
        flights, flight = self.flights, self.flight
        keys = [
            flights.readers_key(flight.key, flight.token),
            flights.stream_key(flight.key, flight.token),
            flights.lock_key(flight.key),
        ]
        gone = entry_wire(Entry("gone", detail="the leader's caller left"))
        args: list[ScriptArg] = [flight.token, gone, min(flights.stream_ttl_ms, 10_000)]
        try:
            read = await flights.kv.run_script("flight_stop", flights.stop_script, keys, args)
        except StoreUnavailable:
            # Redis down (the circuit open): no replica can read it either. Refused while
            # Redis is up (this process's commands backlogged, StoreBusy): a replica may read
            # it, so it is read on and asked again at the next check.
            return flights.kv.available
        if read:
            return True
        self._ended_on_redis = True
        return False

    def _end(self, entry: Entry) -> None:
        if self._last is None:
            self._last = entry
            # Nobody can follow it to an answer any more (not "done", not "failed").
            self.flight.abandoned = entry.kind in ("gone", "unshared")
            self._wake.set()

    async def _publish(self) -> None:
        # One span for all its round trips: one a batch, about one a token of a slow model,
        # each a span of its own buried the request's trace (40 of 70 spans of a short answer).
        with _round_trips(self.flights.kv, "flight publish") as trips:
            await self._publish_batches(trips)

    async def _publish_batches(self, trips: _RoundTrips) -> None:
        flights, flight = self.flights, self.flight
        lock = flights.lock_key(flight.key)
        stream = flights.stream_key(flight.key, flight.token)
        renew_every = flights.lock_ttl_ms / 3000.0
        store_ok, released = True, False
        renewed = time.monotonic()  # the lock was taken a moment ago
        try:
            while True:
                try:
                    async with asyncio.timeout(renew_every):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()
                last = self._last
                batch, self._outbox = self._outbox, []
                events = tuple(event for entry in batch for event in entry.events)
                if store_ok and not self._ended_on_redis:
                    # The lock is renewed every third of its TTL, not with every batch (about
                    # one a token): a script in a pipeline costs redis-py a round trip more
                    # (SCRIPT EXISTS) before the pipeline's own.
                    renew = time.monotonic() - renewed >= renew_every
                    store_ok = await self._send(lock, stream, events, last, renew=renew)
                    if renew and store_ok:
                        renewed = time.monotonic()
                    trips.made(len(events) if store_ok else 0)
                    if not store_ok:
                        trips.failed()
                if last is not None:
                    released = store_ok or self._ended_on_redis
                    return
        finally:
            if not released:  # the lock lasts until it expires: nobody here waits on it
                flights.unreleased(flight.key, flight.token)
            # Local followers learn the end after Redis has (the lock is free by then).
            flight.append(self._last or Entry("gone", detail="the publisher stopped"))
            flights.forget(flight)

    async def _send(
        self,
        lock: str,
        stream: str,
        events: tuple[AnswerEvent, ...],
        last: Entry | None,
        *,
        renew: bool,
    ) -> bool:
        flights = self.flights
        ttl = flights.stream_ttl_ms if last is None else min(flights.stream_ttl_ms, 10_000)
        token = self.flight.token

        async def queue(pipe: Any) -> None:
            for entry in (Entry("events", events) if events else None, last):
                if entry is not None:
                    pipe.xadd(
                        stream,
                        {"e": entry_wire(entry)},
                        maxlen=flights.max_entries,
                        approximate=True,
                    )
            pipe.pexpire(stream, ttl)
            if last is not None:
                await flights.release_script(keys=[lock], args=[token], client=pipe)
            elif renew:
                args: list[str | int] = [token, flights.lock_ttl_ms]
                await flights.renew_script(keys=[lock], args=args, client=pipe)

        try:
            await flights.kv.pipeline("flight_publish", queue, transaction=True)
        except StoreUnavailable:
            return False  # remote followers see the lock expire; local ones are unaffected
        return True


class _RoundTrips:
    """A flight task's round trips to Redis and the answer events they carried, for its span."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.count = 0
        self.events = 0

    def made(self, events: int) -> None:
        self.count += 1
        self.events += events

    def failed(self) -> None:
        """Redis failed one: coalescing goes on without it, or stops (not the request's error)."""
        self.span.set_attribute(attr.FLIGHT_STORE_FAILED, True)


@contextlib.contextmanager
def _round_trips(kv: KeyValueStore, name: str) -> Iterator[_RoundTrips]:
    """One span ``name`` for a flight task's round trips to Redis, with none of its own for
    each (``KeyValueStore.untraced``); their count and events on it when the task ends."""
    with current_span(kv.tracer, name) as span, kv.untraced():
        trips = _RoundTrips(span)
        try:
            yield trips
        finally:
            span.set_attribute(attr.FLIGHT_ROUND_TRIPS, trips.count)
            span.set_attribute(attr.FLIGHT_EVENTS, trips.events)


async def _read_remote(flights: SingleFlight, flight: _Led, token: str) -> None:
    # One span for all its round trips: a read every ``poll_ms`` while the leader is silent.
    with _round_trips(flights.kv, "flight read") as trips:
        await _copy_remote(flights, flight, token, trips)


async def _copy_remote(flights: SingleFlight, flight: _Led, token: str, trips: _RoundTrips) -> None:
    """Copy a remote leader's stream into the local flight until its last entry, until no
    local request reads it any more, or until the lock is found gone with the stream idle."""
    stream = flights.stream_key(flight.key, token)
    lock = flights.lock_key(flight.key)
    readers = flights.readers_key(flight.key, token)
    position = "0"
    idle_since = time.monotonic()
    check_every = flights.lock_ttl_ms / 2000.0
    # Counted in with the first read, before it, and again every third of its TTL: it stays
    # counted while it reads, and no longer than its TTL once it cannot (this replica killed,
    # cut off from Redis). A read that cannot count it in is not made: Redis failing ends the
    # reading ("off") rather than leave a reader the leader does not know of.
    count_every = flights.lock_ttl_ms / 3000.0
    counted_at, counting = -count_every, False
    try:
        while not flight.ended:
            if flight.readers <= 0:
                return  # every follower has what it needs, or has gone
            now = time.monotonic()
            count = now - counted_at >= count_every
            counting = counting or count
            read = _xread(stream, position, flights, (readers, flight.token) if count else None)
            reply = await flights.kv.pipeline("flight_read", read)
            if count:
                counted_at = now
            entries = _stream_entries(reply[-1])
            taken = len(flight.entries)
            position = _take(flight, entries, position)
            trips.made(sum(len(entry.events) for entry in flight.entries[taken:]))
            now = time.monotonic()
            if entries:
                idle_since = now
            elif now - idle_since >= check_every:
                idle_since = now
                holder = await flights.kv.get(lock)
                if holder is None or _text(holder) != token:
                    late = await flights.kv.xrange(stream, start=f"({position}", count=1000)
                    position = _take(flight, [_stream_entry(item) for item in late], position)
                    flight.append(Entry("gone", detail="the leader's lock expired"))
    except StoreUnavailable as exc:
        trips.failed()
        flight.append(Entry("off", detail=f"store: {exc.detail}"))
    except MalformedEntry as exc:
        # Another version's leader, or not a flight's stream: its followers here go on alone.
        flight.append(Entry("off", detail=f"an entry of the flight cannot be read ({exc})"))
    finally:
        flight.append(Entry("gone", detail="no reader"))
        try:
            if counting:
                with contextlib.suppress(StoreUnavailable):
                    await flights.kv.pipeline("flight_readers", _not_reading(readers, flight.token))
        finally:
            flights.forget(flight)


def _not_reading(readers: str, reader: str) -> Callable[[Any], Awaitable[None]]:
    async def queue(pipe: Any) -> None:
        pipe.zrem(readers, reader)

    return queue


def _text(value: object) -> str:
    """A Redis reply as text. Never raises: a lock's value that is not UTF-8 is no token of
    ours, and reads as another replica's (whose stream then holds nothing)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _xread(
    stream: str, position: str, flights: SingleFlight, reading: tuple[str, str] | None
) -> Callable[[Any], Awaitable[None]]:
    """One read of the stream (the last reply) and, ``reading`` (the readers, this one) given,
    this replica's reader counted in first. (A script makes redis-py ask Redis whether it has
    it, a round trip more: so only every third of the TTL, not with every poll.)"""

    async def queue(pipe: Any) -> None:
        if reading is not None:
            readers, reader = reading
            args: list[ScriptArg] = [reader, flights.lock_ttl_ms]
            await flights.reading_script(keys=[readers], args=args, client=pipe)
        pipe.xread({stream: position}, count=1000, block=flights.poll_ms)

    return queue


def _take(flight: Flight, entries: list[tuple[str, object]], position: str) -> str:
    """Append the stream's ``entries`` to ``flight``; the position after them (past an entry
    without a flight's field too: else every read would return it again at once)."""
    for entry_id, raw in entries:
        position = entry_id
        if raw is not None:
            flight.append(entry_from_wire(raw))
    return position


def _stream_entries(reply: Any) -> list[tuple[str, object]]:
    """An XREAD reply's entries: their ids, and their flight field (None where it has none)."""
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3 shape
        items: list[Any] = next(iter(reply.values()), [[]])[0]
    else:
        items = reply[0][1]
    return [_stream_entry(item) for item in items]


def _stream_entry(item: Any) -> tuple[str, object]:
    entry_id, fields = item
    return _text(entry_id), fields.get(b"e") if isinstance(fields, dict) else None
