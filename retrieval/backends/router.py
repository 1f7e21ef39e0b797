"""Which backend serves a tenant: a default, per-tenant overrides from settings, and overrides
recorded at run time by `rag backend move` (an `OverrideStore`, in Redis), which win.

The run-time overrides are read once at start and then every `reload_interval_s` by a thread
of their own, so every replica follows a move within that interval without a restart, and the
request path (which asks on the event loop) never waits on Redis. With `reload_interval_s` 0
every read goes to Redis (short-lived processes such as `rag`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Protocol

import redis

from retrieval.backends import BackendUnavailable, RetrievalBackend
from retrieval.backends.moves import MoveFence, WriteLapsed
from retrieval.backends.versions import PolledRedis
from retrieval.tenants import check_tenant


class OverrideStore(Protocol):
    def get(self, tenant: str) -> str | None: ...

    def set(self, tenant: str, backend: str) -> None: ...


class RedisOverrides(PolledRedis):
    """Run-time overrides as one Redis hash (`<prefix>retrieval-backend`: tenant -> name).
    On a Redis failure the last overrides seen stay in force (a move is rare, and a search must
    not fail for want of it)."""

    def __init__(
        self,
        url: str,
        prefix: str = "rag:",
        *,
        timeout_s: float = 0.5,
        reload_interval_s: float = 1.0,
        cluster: bool = False,
    ) -> None:
        super().__init__(url, "backend-overrides", timeout_s, reload_interval_s, cluster)
        # On a cluster the hash and the move fence's keys share a slot (the fence's scripts
        # use all three): one tag for them all, since moves and writes' admissions are rare.
        self.prefix = prefix + ("{backends}:" if cluster else "")
        self.key = f"{self.prefix}retrieval-backend"
        if reload_interval_s > 0:
            self._refresh()
            self._poller.start()

    def _refresh(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.reload()

    def reload(self) -> None:
        """Read the overrides now (raises redis.RedisError when Redis does not answer)."""
        raw = self.client.hgetall(self.key)
        with self._lock:
            self._seen = {_text(k): _text(v) for k, v in raw.items()}

    def get(self, tenant: str) -> str | None:
        if self.reload_interval_s <= 0:
            self._refresh()
        return self._seen.get(tenant)

    def set(self, tenant: str, backend: str) -> None:
        self.client.hset(self.key, check_tenant(tenant), backend)
        with self._lock:
            self._seen[tenant] = backend

    def fence(self) -> MoveFence:
        """The fence that keeps writes out of a move, on the same Redis, prefix and hash."""
        return MoveFence(self.client, self.prefix, self.key)


class BackendRouter:
    """`backends` by name; `default` serves every tenant not in `tenants` (settings) or in
    `overrides` (run time, which win). A name with no backend configured is a start-up error
    for settings, and a refusal (KeyError) for a run-time override. With a `fence`, writes go
    through `writing` (retrieval.backends.moves)."""

    def __init__(
        self,
        backends: Mapping[str, RetrievalBackend],
        default: str = "embedded",
        tenants: Mapping[str, str] | None = None,
        overrides: OverrideStore | None = None,
        fence: MoveFence | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.fence = fence
        self.default = default
        self.tenants = dict(tenants or {})
        self.overrides = overrides
        for name in {default, *self.tenants.values()}:
            if name not in self.backends:
                raise ValueError(
                    f"retrieval backend {name!r} is not configured "
                    f"(configured: {', '.join(sorted(self.backends))})"
                )

    def name_for(self, tenant: str) -> str:
        override = self.overrides.get(tenant) if self.overrides is not None else None
        return self._named(tenant, override)

    def _named(self, tenant: str, override: str | None) -> str:
        """`override` when it names a configured backend, else the settings' choice."""
        if override is not None and override in self.backends:
            return override
        return self.tenants.get(tenant, self.default)

    def for_tenant(self, tenant: str) -> RetrievalBackend:
        return self.backends[self.name_for(tenant)]

    def reload(self) -> None:
        """Read the run-time overrides now (a move reads them once it holds the fence)."""
        if isinstance(self.overrides, RedisOverrides):
            self.overrides.reload()

    @contextlib.contextmanager
    def writing(self, tenant: str) -> Iterator[RetrievalBackend]:
        """The backend a write of `tenant` goes to, for the length of the write: with a fence,
        the write is registered (a move waits for it) and its backend is the latest record's;
        TenantMoving while a move runs, and WriteLapsed after a write whose registration
        lapsed (it may have missed a move's copy: the caller sends it again); BackendUnavailable
        when Redis does not answer."""
        if self.fence is None:
            yield self.for_tenant(tenant)
            return
        try:
            token, recorded = self.fence.enter(tenant)
        except redis.RedisError as exc:
            raise BackendUnavailable(
                f"Redis (moves between backends) did not answer ({type(exc).__name__}): a "
                "write cannot tell whether its tenant is being moved."
            ) from exc
        try:
            yield self.backends[self._named(tenant, recorded)]
        except BaseException:
            self.fence.leave(tenant, token)
            raise
        if not self.fence.leave(tenant, token):
            raise WriteLapsed(tenant)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        if self.fence is not None:
            self.fence.close()
        if isinstance(self.overrides, RedisOverrides):
            self.overrides.close()

    def record(self, tenant: str, backend: str) -> None:
        """Send `tenant` to `backend` from now on (every process reading the same overrides)."""
        if backend not in self.backends:
            raise KeyError(backend)
        if self.overrides is None:
            raise ValueError("no override store: the tenant's backend is set in settings only")
        self.overrides.set(tenant, backend)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
