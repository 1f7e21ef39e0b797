"""Index versions of tenants whose index is not a snapshot (Milvus): a counter per tenant in
Redis, INCR-ed after every write, so every replica's cache keys change with every write.

Reads are cached for `reload_interval_s` (as IndexStore re-reads its CURRENT pointer), and the
writer's own process sees its new value at once. A replica may thus serve an answer keyed on
the previous version for at most that interval after another process wrote; the same bound
holds for the embedded index. When Redis cannot be reached the last value seen is kept: the
response cache lives in that Redis too, so no stale answer can be served from it meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import redis

from retrieval.store import check_tenant
from retrieval.versions import NO_VERSION


class VersionCounter(Protocol):
    def get(self, tenant: str) -> str: ...

    def bump(self, tenant: str) -> str: ...


class RedisVersions:
    """Per-tenant counters under `prefix` in the Redis at `url` (blocking client: the backend
    calls it from its thread pools; `get` from the loop is one cached GET at most per interval)."""

    def __init__(
        self,
        url: str,
        prefix: str = "rag:",
        *,
        timeout_s: float = 0.5,
        reload_interval_s: float = 0.2,
    ) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = f"{prefix}index-version:"
        self.reload_interval_s = reload_interval_s
        self._seen: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def _key(self, tenant: str) -> str:
        return self.prefix + check_tenant(tenant)

    def get(self, tenant: str) -> str:
        now = time.monotonic()
        seen = self._seen.get(tenant)
        if seen is not None and now - seen[1] < self.reload_interval_s:
            return seen[0]
        try:
            raw = self.client.get(self._key(tenant))
        except redis.RedisError:
            return seen[0] if seen is not None else NO_VERSION
        value = raw.decode() if isinstance(raw, bytes) else NO_VERSION
        self._remember(tenant, value)
        return value

    def bump(self, tenant: str) -> str:
        """Atomically the next version (INCR); raises redis.RedisError when Redis is down, so a
        write is never reported done with the cache keys unchanged."""
        value = str(self.client.incr(self._key(tenant)))
        self._remember(tenant, value)
        return value

    def _remember(self, tenant: str, value: str) -> None:
        with self._lock:
            self._seen[tenant] = (value, time.monotonic())

    def close(self) -> None:
        self.client.close()
