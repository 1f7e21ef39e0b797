"""Writes fenced while `rag backend move` moves a tenant, so that none is lost.

A move copies the tenant's chunks from one backend to the other, records the new backend, and
deletes the tenant from the old one. A write that reached the old backend after its documents
were copied would be deleted with it; a write that went to the new one before the record would
be overwritten by the copy. So, in Redis, shared by every replica and `rag`:

- `<prefix>backend-move:<tenant>`: the mover's token while a move runs (it expires after
  `MOVE_TTL_S` unless the mover renews it, so a killed mover frees the tenant).
- `<prefix>backend-writes:<tenant>`: the writes under way, token -> lease end (ms, Redis's
  clock). A writer renews its lease every `lease_s / 3` while it writes; a killed writer's
  lease ends after `lease_s`.

A write enters with one script (`_ENTER`): refused (`TenantMoving`) while a move runs, else
registered, and told the tenant's run-time backend in the same step, so it writes where the
latest record says (a replica's polled copy of the record may be a second old). A move sets its
key, then waits until no registered write is left, and only then copies: every write either
finished before the copy began, or is refused until the move ends.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

import redis

from retrieval.backends.versions import Poller
from retrieval.tenants import check_tenant

MOVE_TTL_S = 30.0
RETRY_AFTER_S = 5.0

_ENTER = """
local moving = redis.call('PTTL', KEYS[1])
if moving ~= -2 then return {0, tostring(moving)} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) * 4)
local backend = redis.call('HGET', KEYS[3], ARGV[3])
if not backend then backend = '' end
return {1, backend}
"""
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 4)
return 1
"""
_IN_FLIGHT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
_IF_HELD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == 'end' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
"""


class TenantMoving(RuntimeError):
    """A write of a tenant whose index is being moved: retry after `retry_after_s`."""

    def __init__(self, tenant: str) -> None:
        super().__init__(
            f"Tenant {tenant!r}'s index is being moved to another retrieval backend; writes "
            "resume when the move ends."
        )
        self.tenant = tenant
        self.retry_after_s = RETRY_AFTER_S


class WriteLapsed(TenantMoving):
    """A write whose registration was gone when it ended (its lease lapsed: its process could
    not renew it for `lease_s`, and a move may have copied the tenant without it). The write
    is idempotent: the caller retries, and the retry lands where the tenant now is."""

    def __init__(self, tenant: str) -> None:
        super().__init__(tenant)
        self.args = (
            f"Tenant {tenant!r}'s write outlived its registration (a move may have started "
            "meanwhile); it must be sent again.",
        )


class MoveUnderway(RuntimeError):
    """Another move of the same tenant holds the fence."""


class MoveFence:
    """The fence of the module docstring, on the blocking Redis `client` (thread pools and
    `rag`, never the event loop); `overrides_key` is the hash of run-time backends
    (`RedisOverrides.key`)."""

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        prefix: str,
        overrides_key: str,
        *,
        lease_s: float = 15.0,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.overrides_key = overrides_key
        self.lease_ms = max(1, int(lease_s * 1000))
        self._enter = client.register_script(_ENTER)
        self._renew = client.register_script(_RENEW)
        self._in_flight = client.register_script(_IN_FLIGHT)
        self._if_held = client.register_script(_IF_HELD)
        self._active: dict[str, str] = {}  # this process's writes: token -> tenant
        self._lock = threading.Lock()
        self._renewer = Poller("write-leases", lease_s / 3, self._renew_all)

    def _move_key(self, tenant: str) -> str:
        return f"{self.prefix}backend-move:{check_tenant(tenant)}"

    def _writes_key(self, tenant: str) -> str:
        return f"{self.prefix}backend-writes:{check_tenant(tenant)}"

    # -- writers -----------------------------------------------------------------------------

    def enter(self, tenant: str) -> tuple[str, str | None]:
        """Register a write of `tenant`: its token and the tenant's run-time backend (None
        when none is recorded). TenantMoving while a move runs; redis.RedisError when Redis
        does not answer (a write is then refused: whether a move runs is unknown)."""
        token = uuid.uuid4().hex
        admitted, backend = self._enter(
            keys=[self._move_key(tenant), self._writes_key(tenant), self.overrides_key],
            args=[token, self.lease_ms, tenant],
        )
        if not int(admitted):
            raise TenantMoving(tenant)
        with self._lock:
            self._active[token] = tenant
        self._renewer.start()
        name = backend.decode() if isinstance(backend, bytes) else str(backend)
        return token, name or None

    def leave(self, tenant: str, token: str) -> bool:
        """The write is done (or failed): False when its registration was already gone (its
        lease lapsed, and a move may have pruned it: see `WriteLapsed`). A Redis failure here
        is absorbed (True): the lease ends on its own after `lease_s`."""
        with self._lock:
            self._active.pop(token, None)
        try:
            return bool(self.client.zrem(self._writes_key(tenant), token))
        except redis.RedisError:
            return True

    def _renew_all(self) -> None:
        with self._lock:
            by_tenant: dict[str, list[str]] = {}
            for token, tenant in self._active.items():
                by_tenant.setdefault(tenant, []).append(token)
        for tenant, tokens in by_tenant.items():
            with contextlib.suppress(redis.RedisError):  # tried again next round
                self._renew(keys=[self._writes_key(tenant)], args=[self.lease_ms, *tokens])

    # -- the mover ---------------------------------------------------------------------------

    def begin(self, tenant: str, ttl_s: float = MOVE_TTL_S) -> str:
        """Fence `tenant`'s writes; the move's token. MoveUnderway if another move holds it."""
        token = uuid.uuid4().hex
        if not self.client.set(self._move_key(tenant), token, nx=True, px=int(ttl_s * 1000)):
            raise MoveUnderway(f"Another move of tenant {tenant!r} is under way.")
        return token

    def holds(self, tenant: str, token: str, ttl_s: float = MOVE_TTL_S) -> bool:
        """Renew the move's fence; False when it is no longer this move's (it lapsed)."""
        held: Any = self._if_held(keys=[self._move_key(tenant)], args=[token, int(ttl_s * 1000)])
        return bool(int(held))

    def end(self, tenant: str, token: str) -> None:
        """Lift the fence (only this move's)."""
        self._if_held(keys=[self._move_key(tenant)], args=[token, "end"])

    def writes_in_flight(self, tenant: str) -> int:
        """How many registered writes of `tenant` are still within their lease."""
        return int(self._in_flight(keys=[self._writes_key(tenant)]))

    def close(self) -> None:
        self._renewer.stop()
