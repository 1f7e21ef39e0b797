"""Which backend serves a tenant: a default, per-tenant overrides from settings, and overrides
recorded at run time by `rag backend move` (an `OverrideStore`, in Redis), which win.

The run-time override is read through a short cache (`reload_interval_s`), so every replica
follows a move within that interval without a restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Protocol

import redis

from retrieval.backends import RetrievalBackend
from retrieval.store import check_tenant


class OverrideStore(Protocol):
    def get(self, tenant: str) -> str | None: ...

    def set(self, tenant: str, backend: str) -> None: ...


class RedisOverrides:
    """Run-time overrides as one Redis hash (`<prefix>retrieval-backend`: tenant -> name)."""

    def __init__(
        self,
        url: str,
        prefix: str = "rag:",
        *,
        timeout_s: float = 0.5,
        reload_interval_s: float = 1.0,
    ) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.key = f"{prefix}retrieval-backend"
        self.reload_interval_s = reload_interval_s
        self._seen: dict[str, str] = {}
        self._checked = -1e18
        self._lock = threading.Lock()

    def get(self, tenant: str) -> str | None:
        """The tenant's override; on a Redis failure the last one seen (a move is rare, and a
        search must not fail for want of it)."""
        now = time.monotonic()
        if now - self._checked >= self.reload_interval_s:
            try:
                raw = self.client.hgetall(self.key)
            except redis.RedisError:
                raw = None
            with self._lock:
                # A failure waits the interval too: Redis down must not cost every request a
                # connect timeout.
                self._checked = now
                if raw is not None:
                    self._seen = {_text(k): _text(v) for k, v in raw.items()}
        return self._seen.get(tenant)

    def set(self, tenant: str, backend: str) -> None:
        self.client.hset(self.key, check_tenant(tenant), backend)
        with self._lock:
            self._seen[tenant] = backend

    def close(self) -> None:
        self.client.close()


class BackendRouter:
    """`backends` by name; `default` serves every tenant not in `tenants` (settings) or in
    `overrides` (run time, which win). A name with no backend configured is a start-up error
    for settings, and a refusal (KeyError) for a run-time override."""

    def __init__(
        self,
        backends: Mapping[str, RetrievalBackend],
        default: str = "embedded",
        tenants: Mapping[str, str] | None = None,
        overrides: OverrideStore | None = None,
    ) -> None:
        self.backends = dict(backends)
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
        if override is not None and override in self.backends:
            return override
        return self.tenants.get(tenant, self.default)

    def for_tenant(self, tenant: str) -> RetrievalBackend:
        return self.backends[self.name_for(tenant)]

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
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
    return value.decode() if isinstance(value, bytes) else value
