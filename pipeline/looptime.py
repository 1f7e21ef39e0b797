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
The lag is what a clock ticking every ``TICK_S`` sees: how late each tick runs, summed. The
later a tick runs, the sooner the next (``TICK_S`` squared over ``TICK_S`` plus its lateness),
and a long turn gives a bound about that gap of its time. So the stretch grows smoothly with the
loop's turns: measured with a bound of 50 ms, 1.1x its length with turns of 0.5 ms, 1.2x with
1.2 ms, 1.9x with 3 ms, 3.6x with 8 ms, 6.8x with 12 ms, and the cap from turns of 20 ms. An
await of a few round trips, each waiting a turn or two of a backlogged loop, is then not cut
off by the turns' length. A
dependency that is slow while the loop keeps time still fails at the bound; a loop that is never
on time still ends it, at ``MAX_STRETCH`` times the bound on the wall clock. The bounded code's
own work on the loop counts as lag too: a stage that blocks the loop cannot be cut off during
it, and once it is done, its result is not thrown away. Where a caller needs a bound on the
wall clock (the request's deadline, a tool's timeout), it keeps ``asyncio.timeout``.

The clock ticks only while some bound is open, a watcher (``LoopLag.watch``) reads its ticks, or
some work holds it (``LoopLag.hold``: the app holds it while it serves a request), and stops at
the first tick that finds none of them, so bounds opened back to back share one running clock.
The app's lag probe (``app/lag.py``) watches the same ticks rather than waking the loop on a
timer of its own.

It ticks every ``TICK_S`` while a request is served or a bound shorter than ``FINE_UNDER_S`` is
open, and every ``COARSE_TICK_S`` otherwise: a resting process always has a bound open (its key
listener's and job workers' long polls, their Redis commands) and the probe's watcher, and on
these machines each wakeup of a 100 Hz clock cost a resting replica about 10 ms of CPU per
second. A stall is undercounted by at most the gap between ticks, and a loop backlogged in
turns of 20 ms has about a fifth of its lag counted by the coarse clock, where the fine one
counts most of it: a long bound outside any request (a Redis command of the key listener or a
job worker's poll) is stretched less on a busy loop. A stall during a request shows to within
``TICK_S``. A Redis timeout under ``FINE_UNDER_S`` makes every idle command tick the clock
finely. Work that needs the fine clock switches a coarse one at once (its pending tick, due
later, is cancelled).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Final

TICK_S: Final = 0.01
# With no request served and no bound shorter than FINE_UNDER_S open: ten ticks a second.
COARSE_TICK_S: Final = 0.1
FINE_UNDER_S: Final = 5 * COARSE_TICK_S
# At most this many times a bound on the wall clock, whatever the loop's lag.
MAX_STRETCH: Final = 10.0
# Less than this left of a bound when its timer fires: spent (the loop's clock is coarser).
SLACK_S: Final = 0.0005

# Per loop, and the last one asked for, found without the dictionary. A clock holds no
# reference to its loop (its pending tick is the loop's), so neither keeps a closed loop alive.
_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = weakref.WeakKeyDictionary()
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], LoopLag] | None = None


class LoopLag:
    """The lag of one event loop, summed over the time some bound was open."""

    __slots__ = ("_due", "_fine", "_pending", "_summed", "_ticking", "_users", "_watchers")

    def __init__(self) -> None:
        self._users = 0
        self._fine = 0  # of the users, those that need a tick every TICK_S
        self._summed = 0.0
        self._due = 0.0
        self._ticking = False
        # The pending tick's timer, to cancel when a sooner one is needed (a coarse tick, when
        # fine ones become needed before it is due). Weakly: the timer holds the loop.
        self._pending: weakref.ref[asyncio.TimerHandle] | None = None
        # Called at every tick with (how late it ran, the loop's time then).
        self._watchers: tuple[Callable[[float, float], None], ...] = ()

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
        return self._ticking

    @property
    def fine(self) -> bool:
        """Whether it ticks every ``TICK_S`` (else every ``COARSE_TICK_S``), while it ticks."""
        return self._fine > 0

    def summed(self, now: float) -> float:
        """The lag until ``now`` (the loop's time): how late the ticks ran, and the pending
        tick's lateness if it is overdue (the loop is late right now, before the tick ran)."""
        if not self._ticking or now <= self._due:
            return self._summed
        return self._summed + now - self._due

    def hold(self, loop: asyncio.AbstractEventLoop, now: float, *, fine: bool = True) -> None:
        """Keep the clock ticking until ``release`` (with the same ``fine``): every ``TICK_S``
        while some holder is ``fine``, else every ``COARSE_TICK_S``. ``now``: the loop's time."""
        self._users += 1
        if fine:
            self._fine += 1
            if self._ticking and self._due > now + TICK_S:  # a coarse tick is pending: sooner
                pending = self._pending() if self._pending is not None else None
                if pending is not None:
                    pending.cancel()  # it will not wake the loop
                self._schedule(loop, now + TICK_S)
        if not self._ticking:
            self._ticking = True
            self._schedule(loop, now + (TICK_S if self._fine else COARSE_TICK_S))

    def release(self, *, fine: bool = True) -> None:
        # The clock runs on to its next tick, which stops it if nobody holds it by then.
        self._users -= 1
        if fine:
            self._fine -= 1

    def _schedule(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self._due = due
        self._pending = weakref.ref(loop.call_at(due, self._tick, loop))

    def watch(
        self, loop: asyncio.AbstractEventLoop, watcher: Callable[[float, float], None]
    ) -> None:
        """Call ``watcher(late, now)`` at every tick until ``unwatch`` (the same object):
        how late the tick ran and the loop's time then. The clock ticks all that while, at
        least every ``COARSE_TICK_S`` while the loop keeps time (every ``TICK_S`` while a
        request is served or a short bound is open; sooner after a late tick). A watcher that
        raises is reported to the loop's exception handler once and unwatched. It must hold no
        reference to the loop: the clock would then keep a closed loop alive."""
        self._watchers = (*self._watchers, watcher)
        self.hold(loop, loop.time(), fine=False)

    def unwatch(self, watcher: Callable[[float, float], None]) -> None:
        for index, watching in enumerate(self._watchers):
            if watching is watcher:
                self._watchers = self._watchers[:index] + self._watchers[index + 1 :]
                self.release(fine=False)
                return

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        late = max(now - self._due, 0.0)
        self._summed += late
        if self._users <= 0:
            self._ticking = False
            return
        # The later the tick, the sooner the next: a long turn gives a bound about the gap
        # between ticks of its time, so a backlogged loop's turns each count little of a
        # bound, while a loop that keeps time ticks every TICK_S (smoothly between the two).
        gap = TICK_S if self._fine > 0 else COARSE_TICK_S
        self._schedule(loop, now + gap * gap / (gap + late))
        for watcher in self._watchers:  # after the next tick is set: it ticks on regardless
            try:
                watcher(late, now)
            except Exception as exc:  # not every tick's, and not the watchers' after it
                self.unwatch(watcher)
                loop.call_exception_handler(
                    {"message": "a LoopLag watcher raised: it was unwatched", "exception": exc}
                )


class Serving:
    """``with Serving():`` holds the running loop's clock fine (a tick every ``TICK_S``) while a
    request or a job is served: a stall in it shows to within ``TICK_S``."""

    __slots__ = ("_clock",)

    def __enter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._clock = LoopLag.of(loop)
        self._clock.hold(loop, loop.time())

    def __exit__(self, *exc: object) -> None:
        self._clock.release()


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
        "_entered",
        "_expired",
        "_fine",
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
        self._entered = False
        self._clock: LoopLag | None = None  # held from the entry to the exit, if any

    async def __aenter__(self) -> Bound:
        if self._entered:
            raise RuntimeError("a Bound is entered once")
        self._entered = True
        if self.seconds is None:
            return self
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Bound should be used inside a task")
        loop = self._loop = asyncio.get_running_loop()
        started = self._started = loop.time()
        at = started + self.seconds  # a bad `seconds` fails here, before the clock is held
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        clock = LoopLag.of(loop)
        self._fine = self.seconds < FINE_UNDER_S  # released as it was held, come what may
        clock.hold(loop, started, fine=self._fine)
        self._clock = clock
        self._lag_at = clock.summed(started)
        self._handle: asyncio.Handle | None = loop.call_at(at, self._expire)
        return self

    def _expire(self) -> None:
        seconds, clock = self.seconds, self._clock
        assert seconds is not None and clock is not None
        now = self._loop.time()
        self.lag_s = clock.summed(now) - self._lag_at
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
        clock = self._clock
        if clock is None:
            return  # no bound
        self._clock = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.lag_s = clock.summed(self._loop.time()) - self._lag_at
        clock.release(fine=self._fine)
        # uncancel() first, whatever ended the block, as asyncio.timeout does.
        expired = self._expired and self._task.uncancel() <= self._cancelling
        if expired and kind is asyncio.CancelledError:
            raise TimeoutError from error
