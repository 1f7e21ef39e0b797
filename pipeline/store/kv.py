"""Redis access for the request path: spans per command, errors converted, a short circuit breaker.

When Redis cannot be reached, callers get ``StoreUnavailable`` (``pipeline.errors``: a 503
with ``Retry-After``, converted here from redis-py's exceptions and nowhere else) at once, and
for ``retry_after`` seconds after a failure no request waits on a connect attempt; then the next
call tries again, so the service recovers by itself when Redis is back.

A full connection pool is not Redis being down: a command waits up to ``pool_wait`` seconds for
a free connection, and if none comes, that command alone fails (``StoreBusy``, a
``StoreUnavailable``; metric kind ``MaxConnectionsError``); the circuit stays closed for every
other request.

``timeout`` bounds each command's whole round trip (taking a connection, the send, the reply,
the one retry on a stale connection) with one timer, instead of redis-py's own per socket
operation (a task per send and a timer per read on Python 3.11: an eighth of a cache hit). It
counts only time in which the event loop ran on time (``pipeline.looptime.Bound``): a loop
stalled or backlogged past the bound is not Redis being down, and does not open the circuit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from functools import partial
from typing import Any, Final, Literal

import redis.asyncio as redis
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MaxConnectionsError,
    NoScriptError,
    OutOfMemoryError,
    RedisClusterException,
    RedisClusterUnreachableError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import StoreBusy, StoreUnavailable
from pipeline.looptime import Bound
from pipeline.telemetry import metrics
from pipeline.telemetry.spans import in_unsampled_trace, mark_failed

ScriptArg = str | int | float | bytes


# redis-py's exceptions, converted here and nowhere else: those that mean Redis cannot be
# reached open the circuit; any other Redis error fails the one command. A cluster's own
# (no node answers, a slot uncovered) are not RedisErrors: they are listed apart.
UNREACHABLE: Final = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    RedisClusterUnreachableError,
)
# Set (``KeyValueStore.untraced``) in a task whose many round trips one span of its own sums
# up (a coalesced flight's publisher and reader): no span per command there.
_UNTRACED: ContextVar[bool] = ContextVar("rag_kv_untraced", default=False)

# redis-py's own bound on a connect, behind the store's bound on the whole command.
CONNECT_BACKSTOP_S: Final = 5.0
# Redis out of memory is said in the log at most this often (each refused command is counted
# in rag_redis_errors_total; the log is where an operator looks first).
OUT_OF_MEMORY_LOG_EVERY_S: Final = 60.0

log = logging.getLogger(__name__)


def glob_escaped(text: str) -> str:
    """``text`` matched literally in a SCAN pattern (a key prefix may hold ``*`` or ``[``)."""
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


class KeyValueStore:
    """A thin wrapper around one ``redis.asyncio.Redis`` client, or a ``RedisCluster``'s.

    On a Redis Cluster the keys a script or a transaction uses together must share a hash slot:
    the stores name them with ``tag`` (a ``{...}`` hash tag on a cluster, the bare text on one
    Redis, so that a single Redis keeps the key names it always had)."""

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        tracer: trace.Tracer,
        *,
        retry_after: float = 1.0,
        timeout: float | None = None,
        max_commands: int | None = None,
        pool_wait: float = 0.25,
    ) -> None:
        self.client = client
        self.tracer = tracer
        self.retry_after = retry_after
        # One bound on a command's whole round trip (connection, send, reply, the one retry),
        # instead of the client's own per socket operation: those cost a cache hit ~25 µs
        # (a task per send, a timer per read). None: the client's own timeouts alone.
        self.timeout = timeout
        self.pool_wait = pool_wait
        # At most ``max_commands`` commands at once; the next waits up to ``pool_wait`` for
        # one to end, then fails alone (``StoreBusy``). Taken without a timer when one is free.
        self._slots = asyncio.Semaphore(max_commands) if max_commands else None
        self._max_commands = max_commands
        self._down_until = 0.0
        self._out_of_memory_said = -OUT_OF_MEMORY_LOG_EVERY_S
        self.cluster = isinstance(client, redis.RedisCluster)
        # On a cluster, the scripts a pipeline runs must be loaded on its node beforehand
        # (redis-py loads a script by itself only when it runs outside a pipeline): every
        # registered script is loaded on every primary before the first pipeline, and again
        # after a node answered NOSCRIPT (a failover, a node added).
        self._scripts: dict[str, str] = {}  # by SHA1
        self._loaded: set[str] = set()  # the SHA1s loaded on every primary
        self._loading = asyncio.Lock()  # pipelines that find scripts unloaded wait for one load

    @classmethod
    def from_url(
        cls,
        url: str,
        tracer: trace.Tracer,
        *,
        timeout: float = 0.5,
        retry_after: float = 1.0,
        max_connections: int = 256,
        pool_wait: float = 0.25,
        cluster: bool = False,
    ) -> KeyValueStore:
        """``cluster``: ``url`` names one node of a Redis Cluster, which tells the client the
        others (``max_connections`` is then per node)."""
        options: dict[str, Any] = dict(
            max_connections=max_connections,
            # Every command, a connect inside it included, is under the store's own bound,
            # which does not count the event loop's lag; the client's own bound on a connect
            # counts it, so a burst that backlogs the loop while the pool grows failed connects
            # (and opened the circuit) at `timeout`. It is only a backstop now.
            socket_connect_timeout=max(timeout, CONNECT_BACKSTOP_S),
            socket_timeout=None,  # `timeout` bounds each command (redis-py's default is 5 s)
            # One quick retry replaces a connection that went stale while Redis restarted;
            # more would only multiply the wait while it is down.
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0,
        )
        client: redis.Redis | redis.RedisCluster = (
            redis.RedisCluster.from_url(url, **options)
            if cluster
            else redis.Redis.from_pool(redis.ConnectionPool.from_url(url, **options))
        )
        return cls(
            client,
            tracer,
            retry_after=retry_after,
            timeout=timeout,
            max_commands=max_connections,
            pool_wait=pool_wait,
        )

    def tag(self, part: str) -> str:
        """``part`` as a hash tag on a cluster (``{part}``: keys whose names carry the same one
        are in one slot, so one script or transaction may use them together), else as is.
        Braces in ``part`` are dropped on a cluster: a tag ends at its first ``}``, so a part
        that held one (a cache key with its tenant's tag) would be tagged by its start alone."""
        if not self.cluster:
            return part
        return "{" + part.replace("{", "").replace("}", "") + "}"

    def slot(self, part: str) -> str:
        """A name's segment that puts keys in ``part``'s slot on a cluster (``{part}:``),
        nothing on one Redis: for groups of keys whose names do not already share a part."""
        return f"{{{part}}}:" if self.cluster else ""

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def _call(self, command: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if not self.available:
            metrics.redis_failed(command, "circuit_open")
            raise StoreUnavailable(
                "circuit open", retry_after_s=self._down_until - time.monotonic()
            )
        # In a trace that is not sampled the span would be dropped: none is made (~15 µs of
        # a cache hit's ~200 µs).
        spanned: AbstractContextManager[trace.Span] = (
            nullcontext(trace.INVALID_SPAN)
            if _UNTRACED.get() or in_unsampled_trace()
            else self.tracer.start_as_current_span(
                f"redis {command}",
                kind=SpanKind.CLIENT,
                attributes={"db.system.name": "redis", "db.operation.name": command},
                record_exception=False,
                set_status_on_exception=False,
            )
        )
        with spanned as span:
            await self._take_slot(command, span)
            try:
                # On expiry redis-py drops the connection it was using (a late reply never
                # reaches the next command) and this raises TimeoutError, an OSError: Redis
                # is unreachable.
                async with Bound(self.timeout):
                    result = await fn()
            except (*UNREACHABLE, RedisError, RedisClusterException) as exc:
                if isinstance(exc, UNREACHABLE) and not isinstance(exc, MaxConnectionsError):
                    self._down_until = time.monotonic() + self.retry_after
                metrics.redis_failed(command, type(exc).__name__)
                mark_failed(span, exc)
                if isinstance(exc, OutOfMemoryError):
                    self._say_out_of_memory(command)
                if isinstance(exc, MaxConnectionsError):
                    raise StoreBusy(f"redis {command}: {exc}", retry_after_s=1.0) from exc
                raise StoreUnavailable(
                    f"redis {command}: {type(exc).__name__}", retry_after_s=self.retry_after
                ) from exc
            finally:
                self._give_slot()
            return result

    def _say_out_of_memory(self, command: str) -> None:
        now = time.monotonic()
        if now - self._out_of_memory_said < OUT_OF_MEMORY_LOG_EVERY_S:
            return
        self._out_of_memory_said = now
        log.warning(
            "Redis refused %s: it is out of memory (maxmemory reached). Until it has room, "
            "answers are not cached, jobs wait, and keys cannot be made (RELIABILITY.md 8b)",
            command,
        )

    @staticmethod
    @contextlib.contextmanager
    def untraced() -> Iterator[None]:
        """No span for the commands run within (in this task), where the caller's own span
        sums them up; failures are still counted in the metrics."""
        token = _UNTRACED.set(True)
        try:
            yield
        finally:
            _UNTRACED.reset(token)

    @contextlib.asynccontextmanager
    async def subscription(self) -> AsyncIterator[PubSub]:
        """A pub/sub connection, which holds one of the pool's connections (one of the
        commands' slots) for as long as it is open."""
        if self._slots is not None:
            await self._slots.acquire()
        pubsub = self.client.pubsub(ignore_subscribe_messages=False)
        try:
            yield pubsub
        finally:
            try:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            finally:
                self._give_slot()

    async def _take_slot(self, command: str, span: trace.Span) -> None:
        """One of the ``max_commands`` slots: at once when one is free, else within
        ``pool_wait`` or ``StoreBusy`` (the circuit stays closed: Redis is not down)."""
        slots = self._slots
        if slots is None:
            return
        if not slots.locked():
            await slots.acquire()  # returns at once
            return
        try:
            async with Bound(self.pool_wait):
                await slots.acquire()
        except TimeoutError:
            metrics.redis_failed(command, "MaxConnectionsError")
            mark_failed(span, kind="MaxConnectionsError")
            raise StoreBusy(
                f"redis {command}: all {self._max_commands} connections busy for "
                f"{self.pool_wait} s",
                retry_after_s=1.0,
            ) from None

    def _give_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self._call("GET", lambda: self.client.get(key))
        return value

    async def set(self, key: str, value: bytes, *, ttl: int | None = None) -> None:
        await self._call("SET", lambda: self.client.set(key, value, ex=ttl))

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        value: dict[bytes, bytes] = await self._call("HGETALL", lambda: self.client.hgetall(key))
        return value

    async def hset(self, key: str, mapping: dict[str, str | int]) -> None:
        fields: Any = mapping
        await self._call("HSET", lambda: self.client.hset(key, mapping=fields))

    async def hdel(self, key: str, *fields: str) -> int:
        count: int = await self._call("HDEL", lambda: self.client.hdel(key, *fields))
        return count

    async def sscan(self, key: str, *, count: int = 1000) -> AsyncIterator[list[bytes]]:
        """A set's members, in steps of about ``count`` (SSCAN: a member may come twice)."""
        cursor = 0
        while True:
            step = partial(self.client.sscan, key, cursor, count=count)
            cursor, found = await self._call("SSCAN", step)
            if found:
                yield list(found)
            if not cursor:
                return

    async def publish(self, channel: str, message: str) -> int:
        receivers: int = await self._call("PUBLISH", lambda: self.client.publish(channel, message))
        return receivers

    async def delete(self, key: str) -> int:
        count: int = await self._call("DEL", lambda: self.client.delete(key))
        return count

    # --- scripts and streams (the job queue) ---

    def script(
        self, text: str, *, when_full: Literal["as redis", "refuse", "run"] = "as redis"
    ) -> AsyncScript:
        """Register a Lua script; run it with ``run_script`` (EVALSHA, loaded on first use).

        With Redis out of memory (``maxmemory`` reached, ``noeviction``) a script runs or not
        by its first write: refused if that write needs memory, run whole if it only deletes
        (``"as redis"``). ``"refuse"``: refused whole before it runs while Redis is over its
        limit (a ``#!lua`` script), for one whose work is wasted unless its outcome can be
        stored (a job's start, which begins by deleting: it ran, the finish that stores the
        answer was refused, and the job ran three times, then failed). ``"run"``: run even
        then (``allow-oom``), for one that records an outcome already paid for (a job's
        answer): Redis may go past its limit by what it stores."""
        header = {"as redis": "", "refuse": "#!lua\n", "run": "#!lua flags=allow-oom\n"}
        script = self.client.register_script(header[when_full] + text)
        if self.cluster:
            self._scripts[script.sha] = header[when_full] + text
        return script

    async def run_script(
        self, name: str, script: AsyncScript, keys: Sequence[str], args: Sequence[ScriptArg]
    ) -> Any:
        """Run a registered script: all of its writes happen together or, if Redis is
        unreachable, none of them."""
        return await self._call(f"EVALSHA {name}", lambda: script(keys=list(keys), args=list(args)))

    async def xgroup_create(self, stream: str, group: str) -> bool:
        """Create the consumer group (and the stream) unless it exists; True when created."""

        async def create() -> bool:
            try:
                await self.client.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" in str(exc):
                    return False
                raise
            return True

        created: bool = await self._call("XGROUP CREATE", create)
        return created

    async def xreadgroup(
        self, stream: str, group: str, consumer: str, *, count: int, block_ms: int | None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """New entries for this consumer (at most ``count``), waiting up to ``block_ms``."""
        reply: Any = await self._call(
            "XREADGROUP",
            lambda: self.client.xreadgroup(
                group, consumer, {stream: ">"}, count=count, block=block_ms
            ),
        )
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3 shape
            entries: list[Any] = next(iter(reply.values()), [[]])[0]
        else:
            entries = reply[0][1]
        return [(entry_id, fields) for entry_id, fields in entries if fields is not None]

    async def xautoclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Take over entries that another consumer left unacknowledged for ``min_idle_ms``."""
        reply: Any = await self._call(
            "XAUTOCLAIM",
            lambda: self.client.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id="0-0", count=count
            ),
        )
        return [(entry_id, fields) for entry_id, fields in reply[1] if fields is not None]

    async def xclaim_touch(self, stream: str, group: str, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of entries this consumer is still working on (a heartbeat)."""
        if ids:
            claimed: list[Any] = list(ids)
            await self._call(
                "XCLAIM",
                lambda: self.client.xclaim(stream, group, consumer, 0, claimed, justid=True),
            )

    async def xlen(self, stream: str) -> int:
        length: int = await self._call("XLEN", lambda: self.client.xlen(stream))
        return length

    # --- pipelines (the feature store) ---

    async def pipeline(
        self,
        name: str,
        queue: Callable[[Any], Awaitable[None]],
        *,
        transaction: bool = False,
        errors_in_place: bool = False,
    ) -> list[Any]:
        """Several commands in one round trip, under one span: ``queue`` adds them to the
        pipeline it is given (a registered script is queued by awaiting it with
        ``client=pipe``); their replies come back in order. ``transaction``: MULTI/EXEC.
        ``errors_in_place``: a command that Redis refuses (a name holding another type) gives
        its error as its reply, rather than failing the whole pipeline."""

        if len(self._loaded) < len(self._scripts):
            await self._load_scripts()

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=transaction) as pipe:
                await queue(pipe)
                try:
                    replies: list[Any] = await pipe.execute(raise_on_error=not errors_in_place)
                except NoScriptError:
                    # A node that lost its scripts: this pipeline fails (its other commands
                    # may have run), the next one loads them again.
                    self._loaded.clear()
                    raise
                return replies

        replies: list[Any] = await self._call(name, run)
        return replies

    async def _load_scripts(self) -> None:
        """Every registered script on every primary of the cluster (SCRIPT LOAD goes to all),
        each load a command with its own bound. Pipelines that come meanwhile wait for this
        load (a pipeline run before it ends would meet NOSCRIPT); a script counts as loaded once
        its load succeeded, so a failed load is tried again by the next pipeline."""
        async with self._loading:  # those loaded while this one waited are not loaded again
            for sha, text in list(self._scripts.items()):
                if sha not in self._loaded:
                    await self._call("SCRIPT LOAD", partial(self.client.script_load, text))
                    self._loaded.add(sha)

    async def scan(
        self, pattern: str, *, kind: str | None = None, count: int = 1000
    ) -> list[bytes]:
        """Every key whose name matches the glob ``pattern`` (and of type ``kind``: "stream",
        "hash"...), by SCAN, ``count`` keys a step."""
        keys: list[bytes] = []
        nodes: list[Any] = [None]
        if isinstance(self.client, redis.RedisCluster):
            # A cluster's keys are spread over its primaries: each is scanned in turn (the
            # client learns them on its first command).
            await self._call("CLUSTER SLOTS", self.client.initialize)
            nodes = self.client.get_primaries()
        for node in nodes:
            on = {"target_nodes": node} if node is not None else {}
            cursor = 0
            while True:
                step = partial(
                    self.client.scan, cursor, match=pattern, count=count, _type=kind, **on
                )
                reply = await self._call("SCAN", step)
                cursor, found = reply
                if isinstance(cursor, dict):  # a cluster's reply: {node: cursor}
                    cursor = next(iter(cursor.values()), 0)
                keys.extend(found)
                if not cursor:
                    break
        return keys

    async def xrange(
        self, stream: str, *, start: str = "-", count: int = 1000
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to ``count`` entries of a stream from ``start`` on (``(id``: after ``id``)."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self._call(
            "XRANGE", lambda: self.client.xrange(stream, min=start, max="+", count=count)
        )
        return entries

    async def ping(self) -> bool:
        # Health checks probe for real even while the circuit is open; one of the slots, like
        # any command (a connection the semaphore does not count would leave a slot with none).
        try:
            await self._take_slot("PING", trace.INVALID_SPAN)
        except StoreBusy:
            return False
        try:
            async with Bound(self.timeout):
                ok = bool(await self.client.ping())
        except (RedisError, OSError):  # TimeoutError is an OSError
            return False
        finally:
            self._give_slot()
        if ok:
            self._down_until = 0.0
        return ok

    async def aclose(self) -> None:
        await self.client.aclose()
