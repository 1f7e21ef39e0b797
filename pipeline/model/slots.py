"""A route's bound on concurrent model calls, shared fairly between tenants.

A route holds at most ``capacity`` calls at once, and each tenant at most ``per_tenant`` of
them, so one tenant's burst (or the streams it opens and never reads) cannot take every upstream
connection. A call that finds no slot it may take waits in its tenant's queue. When a slot frees,
the tenants with a caller waiting take turns (round robin, a tenant at its own bound skipped),
and each tenant's callers go in the order they came. A caller waits until shortly before its
deadline (``GIVE_UP_BEFORE_S``, so that the 503 is ours rather than the runner's 504), then gets
``UpstreamBusy``: 503, code ``upstream_busy``, with ``Retry-After`` the mean time a slot is held.
A caller that has gone meanwhile (``caller_left``: the HTTP layer's, its client closed the
connection) leaves the queue at once with ``ClientClosedRequest`` instead of waiting its turn to
start a generation for nobody.

The bound is per process: each replica bounds its own connections to the model server, so a
route served by N replicas may carry N x ``capacity`` calls, a tenant N x ``per_tenant``.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final

from pipeline.errors import ClientClosedRequest, UpstreamBusy
from pipeline.telemetry import metrics

GIVE_UP_BEFORE_S: Final = 0.25
_HOLD_SMOOTHING: Final = 0.2  # weight of the newest hold time in the running mean

# For the request being served: a wait that ends when its caller has gone (None: no such
# signal, as for a job's calls). Awaited only while a call queues, so a call that finds a slot
# costs nothing for it.
caller_left: contextvars.ContextVar[Callable[[], Awaitable[None]] | None] = contextvars.ContextVar(
    "rag_caller_left", default=None
)


class SlotPool:
    """The concurrent-call slots of one route (``name``: its label in the metrics)."""

    def __init__(self, capacity: int, per_tenant: int | None = None, *, name: str = "") -> None:
        if capacity < 1 or (per_tenant is not None and per_tenant < 1):
            raise ValueError("a route needs at least one slot, and a tenant at least one")
        self.capacity = capacity
        self.per_tenant = min(per_tenant or capacity, capacity)
        self.name = name
        self.in_use = 0
        self._held: dict[str, int] = {}
        # Tenants with callers waiting, in turn order (a dict keeps insertion order).
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._mean_hold_s = 1.0
        self._gauges = metrics.RouteSlotMetrics(name)

    def held_by(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def pressure(self, tenant: str | None = None) -> float:
        """How full the route is for a new call: calls holding or awaiting a slot, over the
        slots (below 1: a slot is free; 1: none is; above: a queue). With ``tenant``, the larger
        of that and the same measure of the tenant's own share (a tenant at its bound waits
        however free the route is)."""
        route = (self.in_use + self.waiting) / self.capacity
        if tenant is None:
            return route
        own = (self.held_by(tenant) + len(self._queues.get(tenant, ()))) / self.per_tenant
        return max(route, own)

    @asynccontextmanager
    async def slot(self, tenant: str, deadline: float | None = None) -> AsyncIterator[float]:
        """Hold one slot for ``tenant`` (waiting until shortly before ``deadline``, event-loop
        time); yields the seconds spent waiting."""
        waited = await self.acquire(tenant, deadline)
        loop = asyncio.get_running_loop()
        taken = loop.time()
        try:
            yield waited
        finally:
            self.release(tenant, loop.time() - taken)

    async def acquire(self, tenant: str, deadline: float | None = None) -> float:
        """Take a slot for ``tenant``, waiting for one if need be; the seconds waited."""
        if tenant not in self._queues and self._may_take(tenant):
            self._take(tenant)
            self._gauges.waited(0.0)
            return 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        give_up = None if deadline is None else deadline - GIVE_UP_BEFORE_S
        if give_up is not None and give_up <= started:
            raise self._busy()
        waiter: asyncio.Future[None] = loop.create_future()
        self._queues.setdefault(tenant, deque()).append(waiter)
        self._gauges.set(self.in_use, self.waiting)
        timer = None if give_up is None else loop.call_at(give_up, self._expire, tenant, waiter)
        left = caller_left.get()
        watcher = None if left is None else asyncio.ensure_future(left())
        try:
            if watcher is not None:
                await asyncio.wait((waiter, watcher), return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done() and _ended_well(watcher):
                    self._forget(tenant, waiter)
                    waiter.cancel()
                    raise ClientClosedRequest()
            await waiter
        except asyncio.CancelledError:
            if _ended_well(waiter):
                self.release(tenant)  # granted as the caller was cancelled: pass it on
            else:
                self._forget(tenant, waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if watcher is not None and not watcher.cancel():
                _ended_well(watcher)  # done: its outcome, even an error, is taken
        waited = loop.time() - started
        self._gauges.waited(waited)
        return waited

    def release(self, tenant: str, held_s: float | None = None) -> None:
        self.in_use -= 1
        left = self._held[tenant] - 1
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        if held_s is not None:
            self._mean_hold_s += _HOLD_SMOOTHING * (held_s - self._mean_hold_s)
        self._dispatch()
        self._gauges.set(self.in_use, self.waiting)

    def _may_take(self, tenant: str) -> bool:
        return self.in_use < self.capacity and self.held_by(tenant) < self.per_tenant

    def _take(self, tenant: str) -> None:
        self.in_use += 1
        self._held[tenant] = self.held_by(tenant) + 1
        self._gauges.set(self.in_use, self.waiting)

    def _dispatch(self) -> None:
        """Give free slots to waiting callers, one per tenant per turn."""
        while self.in_use < self.capacity:
            tenant = next((t for t in self._queues if self.held_by(t) < self.per_tenant), None)
            if tenant is None:
                return  # nobody waiting, or every waiting tenant is at its own bound
            queue = self._queues[tenant]
            waiter = queue.popleft()
            del self._queues[tenant]
            if queue:
                self._queues[tenant] = queue  # to the back of the turn order
            if waiter.done():
                continue  # cancelled, not yet forgotten
            self._take(tenant)
            waiter.set_result(None)

    def _expire(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            return
        self._forget(tenant, waiter)
        waiter.set_exception(self._busy())

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        if not queue:
            del self._queues[tenant]
        self._gauges.set(self.in_use, self.waiting)

    def _busy(self) -> UpstreamBusy:
        self._gauges.busy()
        return UpstreamBusy(self.name, retry_after_s=self._mean_hold_s)


def _ended_well(task: asyncio.Future[None]) -> bool:
    """Whether ``task`` ended with a result (a waiter granted its slot; a watcher that saw its
    caller leave, where one that failed has seen nothing)."""
    return task.done() and not task.cancelled() and task.exception() is None
