"""Index versions of tenants whose index is not a snapshot (Milvus): a counter per tenant in
Redis, INCR-ed after every write, so every replica's cache keys change with every write.

Reads are served from memory, refreshed every `reload_interval_s` by a thread of its own (one
MGET of every tenant seen), so the request path, which asks for a version on the event loop to
build its cache key, never waits on Redis except for the first read of a tenant in a process.
The writer's own process sees its new value at once; another replica may serve an answer keyed
on the previous version for about that interval after a write (the same bound as the embedded
index's CURRENT pointer). When Redis cannot be reached the last value seen is kept: the
response cache lives in that Redis too, so no stale answer can be served from it meanwhile.
With `reload_interval_s` 0 every read goes to Redis (short-lived processes such as `rag`).
A tenant not asked about for `forget_after_s` is no longer polled (its next read goes to Redis
once): the poll is of the tenants served now, not of every tenant since the process started (at
100,000 tenants one MGET took 212 ms, longer than its 0.2 s interval). Its last value is kept
aside for a read while Redis is down, which would otherwise say it has no index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis

from retrieval.tenants import check_tenant
from retrieval.versions import NO_VERSION

log = logging.getLogger(__name__)


class VersionCounter(Protocol):
    def get(self, tenant: str) -> str: ...

    def bump(self, tenant: str) -> str: ...

    def check(self) -> None:
        """Raise if a bump could not be made now (a write checks before it changes anything)."""
        ...


class Poller:
    """Calls `refresh` every `interval_s` in a daemon thread, from `start()` until `stop()`;
    a failing refresh is the caller's to absorb (it is called again next time)."""

    def __init__(self, name: str, interval_s: float, refresh: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self._refresh = refresh
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._refresh()
            except Exception:
                # A thread that died here would leave what it refreshes stale for good (a
                # tenant's index version: its cache keys never change again).
                log.exception("%s: a refresh failed; trying again next time", self._thread.name)

    def stop(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join(5)


class PolledRedis:
    """A blocking Redis client (for thread pools and the poller's thread, never the event
    loop) and what was last read through it, which a `Poller` refreshes (`_refresh`) every
    `reload_interval_s`."""

    def __init__(
        self, url: str, name: str, timeout_s: float, reload_interval_s: float, cluster: bool
    ) -> None:
        # ``cluster``: ``url`` names a node of a Redis Cluster (``RAG_REDIS__CLUSTER``).
        self.client: redis.Redis | redis.RedisCluster = (
            redis.RedisCluster if cluster else redis.Redis
        ).from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.reload_interval_s = reload_interval_s
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()
        self._poller = Poller(name, reload_interval_s, self._refresh)

    def _refresh(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._poller.stop()
        self.client.close()


class RedisVersions(PolledRedis):
    """Per-tenant counters under `prefix` in the Redis at `url` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        prefix: str = "rag:",
        *,
        timeout_s: float = 0.5,
        reload_interval_s: float = 0.2,
        forget_after_s: float = 60.0,
        cluster: bool = False,
    ) -> None:
        super().__init__(url, "index-versions", timeout_s, reload_interval_s, cluster)
        self.prefix = f"{prefix}index-version:"
        self.forget_after_s = forget_after_s
        self._asked: dict[str, float] = {}  # when each tenant in _seen was last read
        self._dormant: dict[str, str] = {}  # tenants no longer polled: their last value
        self._bumped: dict[str, float] = {}  # this process's bumps, while a poll may race them

    def _key(self, tenant: str) -> str:
        return self.prefix + check_tenant(tenant)

    def get(self, tenant: str) -> str:
        seen = self._seen.get(tenant)
        if seen is not None and self.reload_interval_s > 0:
            self._asked[tenant] = time.monotonic()
            return seen
        try:
            raw = self.client.get(self._key(tenant))
        except redis.RedisError:
            value = seen if seen is not None else self._dormant.get(tenant, NO_VERSION)
        else:
            value = _version(raw)
        with self._lock:
            self._dormant.pop(tenant, None)
            self._seen.setdefault(tenant, value)  # a bump meanwhile wins
            self._asked[tenant] = time.monotonic()
        if self.reload_interval_s > 0:
            self._poller.start()
        return self._seen[tenant]

    def _refresh(self) -> None:
        tenants = list(self._seen)
        if not tenants:
            return
        started = time.monotonic()
        try:
            keys = [self._key(t) for t in tenants]
            # A cluster's MGET takes keys of one slot: one per slot there.
            values = (
                self.client.mget_nonatomic(keys)
                if isinstance(self.client, redis.RedisCluster)
                else self.client.mget(keys)
            )
        except redis.RedisError:
            return  # keep what was seen; the next round tries again
        now = time.monotonic()
        with self._lock:
            for tenant, raw in zip(tenants, values, strict=True):
                # A bump of this process's since the read began is newer than what it read.
                if self._bumped.get(tenant, started) <= started:
                    self._seen[tenant] = _version(raw)
            self._bumped = {t: at for t, at in self._bumped.items() if at > started}
            # Only while Redis answers: a tenant forgotten while it is down would read as
            # having no version.
            for tenant in tenants:
                if now - self._asked.get(tenant, now) >= self.forget_after_s:
                    self._dormant[tenant] = self._seen.pop(tenant)
                    self._asked.pop(tenant, None)

    def check(self) -> None:
        """redis.RedisError unless Redis answers now."""
        self.client.ping()

    def bump(self, tenant: str) -> str:
        """Atomically the next version (INCR); raises redis.RedisError when Redis is down, so a
        write is never reported done with the cache keys unchanged."""
        value = str(self.client.incr(self._key(tenant)))
        with self._lock:
            self._seen[tenant] = value
            self._asked[tenant] = self._bumped[tenant] = time.monotonic()
        return value


def _version(raw: object) -> str:
    # Never raises: a counter that is not UTF-8 (damaged) is still a version, and a bump
    # (INCR) of it fails, so a write is refused rather than served under unchanged keys.
    return raw.decode(errors="replace") if isinstance(raw, bytes) else NO_VERSION
