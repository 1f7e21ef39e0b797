"""Time bounds that count a dependency's time, not the event loop's backlog.

A bound such as the feature lookup's 50 ms budget, or a Redis command's 0.5 s, is there so
that a slow dependency does not hold the request up. But a timer whose time passed while the
event loop was busy elsewhere (a burst of requests parsed in one process, a garbage collection,
the CPU taken by other threads or processes) fires in the same turn of the loop as the reply
that came in meanwhile, and before the reply is read: ``asyncio.timeout`` then blames the
dependency for the loop's own backlog. In a burst of 256 requests on two cores that made most
feature lookups "run past" 50 ms, so their requests degraded (and, degraded, were neither cached
nor shared with the requests made without defaults), none the faster for it.

``Bound`` counts only the time in which the loop ran on time: when its timer fires, the loop's
lag since the bound began (``LoopLag``) is given back and the timer set again for what is left.
A dependency that is slow while the loop keeps time still fails at the bound; a loop that is
never on time still ends it, at ``MAX_STRETCH`` times the bound on the wall clock. Where a
caller needs a bound on the wall clock (the request's deadline), it keeps ``asyncio.timeout``.

The lag is measured by a clock that ticks while some bound is open, summing how late each tick
runs: every ``TICK_S`` while the loop keeps time, at every turn of the loop while it is busy (a
tick more than ``BUSY_S`` late), so that all of a backlog is counted. It stops at the first tick
that finds no bound open: an idle process makes no wake-ups, and bounds opened back to back
share one running clock.
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType
from typing import Final

TICK_S: Final = 0.01
# A tick later than this found the loop busy; the next comes at the loop's next turn.
BUSY_S: Final = 0.001
# At most this many times a bound on the wall clock, whatever the loop's lag.
MAX_STRETCH: Final = 10.0
# Less than this left of a bound when its timer fires: spent (the loop's clock is coarser).
SLACK_S: Final = 0.0005

# Per loop, and the last one asked for, found without the dictionary; neither keeps a loop.
_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = weakref.WeakKeyDictionary()
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], LoopLag] | None = None


class LoopLag:
    """The lag of one event loop, summed over the time some bound was open."""

    __slots__ = ("_due", "_handle", "_summed", "_users")

    def __init__(self) -> None:
        self._users = 0
        self._summed = 0.0
        self._due = 0.0
        self._handle: asyncio.Handle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopLag:
        global _last
        last = _last
        if last is not None and last[0]() is loop:
            return last[1]
        clock = _clocks.get(loop)
        if clock is None:
            clock = _clocks[loop] = cls()
        _last = (weakref.ref(loop), clock)
        return clock

    @property
    def ticking(self) -> bool:
        return self._handle is not None

    def summed(self, now: float) -> float:
        """The lag until ``now`` (the loop's time): how late the ticks fired, and the pending
        tick's lateness if it is overdue (the loop is late right now, before the tick ran)."""
        if self._handle is None or now <= self._due:
            return self._summed
        return self._summed + now - self._due

    def hold(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        self._users += 1
        if self._handle is None:
            self._due = now + TICK_S
            self._handle = loop.call_at(self._due, self._tick, loop)

    def release(self) -> None:
        # The clock runs on to its next tick, which stops it if nobody holds it by then.
        self._users -= 1

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        late = now - self._due
        if late > 0.0:
            self._summed += late
        if self._users <= 0:
            self._handle = None
            return
        if late > BUSY_S:
            # The loop is busy: tick at its next turn, so the whole of a backlog is counted,
            # not all but TICK_S a turn (the loop does not wait in select while work is ready).
            self._due = now
            self._handle = loop.call_soon(self._tick, loop)
        else:
            self._due = now + TICK_S
            self._handle = loop.call_at(self._due, self._tick, loop)


class Bound:
    """``async with Bound(seconds):`` is ``asyncio.timeout(seconds)`` counted in time the event
    loop ran on time (see the module's docstring): on expiry the task is cancelled and the
    block raises ``TimeoutError``; a cancellation from elsewhere passes through as it is.
    None: no bound. The bound expires at the loop's next turn, after a reply that came in with
    the turn that found it spent. ``lag_s``: the lag not counted, as of the expiry or the exit.
    The cancellation's bookkeeping is ``asyncio.timeout``'s (and ``pipeline.watchdog``'s),
    without its object."""

    __slots__ = (
        "_cancelling",
        "_clock",
        "_expired",
        "_handle",
        "_lag_at",
        "_loop",
        "_started",
        "_task",
        "lag_s",
        "seconds",
    )

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.lag_s = 0.0

    async def __aenter__(self) -> Bound:
        if self.seconds is None:
            return self
        task = asyncio.current_task()
        assert task is not None, "a bound is on an await of a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        loop = self._loop = asyncio.get_running_loop()
        clock = self._clock = LoopLag.of(loop)
        started = self._started = loop.time()
        clock.hold(loop, started)
        self._lag_at = clock.summed(started)
        self._handle: asyncio.Handle | None = loop.call_at(started + self.seconds, self._expire)
        return self

    def _expire(self) -> None:
        seconds = self.seconds
        assert seconds is not None
        now = self._loop.time()
        self.lag_s = self._clock.summed(now) - self._lag_at
        left = seconds - (now - self._started - self.lag_s)
        latest = self._started + seconds * MAX_STRETCH
        if left > SLACK_S and now < latest:
            self._handle = self._loop.call_at(min(now + left, latest), self._expire)
            return
        # At the loop's next turn: after a reply that came in with this one.
        self._handle = self._loop.call_soon(self._cancel)

    def _cancel(self) -> None:
        self._handle = None
        self._expired = True
        self._task.cancel()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.seconds is None:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.lag_s = self._clock.summed(self._loop.time()) - self._lag_at
        self._clock.release()
        # uncancel() first, whatever ended the block, as asyncio.timeout does.
        expired = self._expired and self._task.uncancel() <= self._cancelling
        if expired and kind is asyncio.CancelledError:
            raise TimeoutError from error
