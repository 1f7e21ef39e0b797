"""Redis access for the request path: spans per command, errors converted, a short circuit breaker.

When Redis cannot be reached, callers get ``StoreUnavailable`` at once, and for ``retry_after``
seconds after a failure no request waits on a connect attempt; then the next call tries again,
so the service recovers by itself when Redis is back.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError


class StoreUnavailable(Exception):
    """Redis did not answer (down, refused, timed out)."""


class KeyValueStore:
    """A thin wrapper around one ``redis.asyncio.Redis`` client."""

    def __init__(
        self, client: redis.Redis, tracer: trace.Tracer, *, retry_after: float = 1.0
    ) -> None:
        self.client = client
        self.tracer = tracer
        self.retry_after = retry_after
        self._down_until = 0.0

    @classmethod
    def from_url(
        cls, url: str, tracer: trace.Tracer, *, timeout: float = 0.5, retry_after: float = 1.0
    ) -> KeyValueStore:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            # One quick retry replaces a connection that went stale while Redis restarted;
            # more would only multiply the wait while it is down.
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0,
            max_connections=256,
        )
        return cls(client, tracer, retry_after=retry_after)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def _call(self, command: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if not self.available:
            raise StoreUnavailable("redis is down (circuit open)")
        with self.tracer.start_as_current_span(
            f"redis {command}",
            kind=SpanKind.CLIENT,
            attributes={"db.system.name": "redis", "db.operation.name": command},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                result = await fn()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._down_until = time.monotonic() + self.retry_after
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.set_attribute("error.type", type(exc).__name__)
                raise StoreUnavailable(f"redis unreachable: {type(exc).__name__}") from exc
            except RedisError as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.set_attribute("error.type", type(exc).__name__)
                raise StoreUnavailable(f"redis error: {exc}") from exc
            return result

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

    async def delete(self, key: str) -> int:
        count: int = await self._call("DEL", lambda: self.client.delete(key))
        return count

    async def ping(self) -> bool:
        # Health checks probe for real even while the circuit is open.
        try:
            ok = bool(await self.client.ping())
        except (RedisError, OSError):
            return False
        if ok:
            self._down_until = 0.0
        return ok

    async def aclose(self) -> None:
        await self.client.aclose()
