"""``pipeline.looptime.Bound``: a time bound that counts a dependency's time, not the event
loop's backlog. On a loop that keeps time it is ``asyncio.timeout``; on a backlogged loop it
lets a reply that came in during the backlog be read, where ``asyncio.timeout`` cancels it in
the same turn; and a loop that stays backlogged still ends it."""

from __future__ import annotations

import asyncio
import gc
import itertools
import statistics
import threading
import time
import weakref

import pytest

from pipeline.looptime import COARSE_TICK_S, FINE_UNDER_S, TICK_S, Bound, LoopLag
from tests.support.backlog import backlog


def reply_from_a_thread(after_s: float) -> asyncio.Future[str]:
    """A future set from another thread ``after_s`` from now, as a socket's reply wakes the
    loop: it is read at the loop's next turn, however busy this one is."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()
    timer = threading.Timer(after_s, loop.call_soon_threadsafe, (future.set_result, "reply"))
    timer.start()
    return future


async def test_an_await_that_outlasts_the_bound_on_a_loop_that_keeps_time_times_out() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with Bound(0.05) as bound:
            await asyncio.sleep(30)
    # Not a speed assertion: the bound ended the 30 s wait, near its 0.05 s on an idle loop.
    assert loop.time() - started < 10
    assert bound.lag_s < 0.05


async def test_a_reply_that_came_during_a_backlog_is_read_where_asyncio_timeout_drops_it() -> None:
    # Each turn of the loop takes 60 ms; the reply comes after 20 ms, in the first turn. Both
    # bounds' timers are found expired at the start of the second turn, with the reply: the
    # plain timeout cancels the waiting task before it runs, the loop-time bound gives the
    # backlog back and the task reads its reply one turn later.
    neighbour = asyncio.create_task(backlog(0.06, 0.5))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await reply_from_a_thread(0.02)
    await neighbour

    neighbour = asyncio.create_task(backlog(0.06, 0.5))
    async with Bound(0.05) as bound:
        assert await reply_from_a_thread(0.02) == "reply"
    await neighbour
    assert bound.lag_s > 0.0


async def test_a_loop_that_stays_backlogged_still_ends_the_bound() -> None:
    # Turns of 30 ms and an await that never ends: each tick of the lag clock (10 ms) counts,
    # so 0.05 s of the bound pass within some turns. The outer timeout turns a hang into a
    # failure.
    neighbour = asyncio.create_task(backlog(0.03, 20.0))
    try:
        async with asyncio.timeout(15):
            with pytest.raises(TimeoutError):
                async with Bound(0.05):
                    await asyncio.get_running_loop().create_future()
    finally:
        neighbour.cancel()


async def test_the_lag_clock_ticks_only_while_a_bound_is_open() -> None:
    clock = LoopLag.of(asyncio.get_running_loop())
    async with Bound(1.0), Bound(2.0):
        await asyncio.sleep(0.05)
        assert clock.ticking
    await asyncio.sleep(0.05)  # its next tick finds nobody holding it
    assert not clock.ticking
    async with Bound(None):  # no bound: no clock
        await asyncio.sleep(0.02)
    assert not clock.ticking


async def test_a_watcher_sees_every_tick_and_its_lateness_until_it_stops_watching() -> None:
    loop = asyncio.get_running_loop()
    clock = LoopLag.of(loop)
    ticks: list[tuple[float, float]] = []

    def watcher(late: float, now: float) -> None:
        ticks.append((late, now))

    clock.watch(loop, watcher)
    await asyncio.sleep(0.05)
    assert clock.ticking  # no bound open: the watcher alone keeps the clock going
    clock.hold(loop, loop.time())  # as a request does: a tick every TICK_S
    await asyncio.sleep(0.05)
    time.sleep(0.06)  # noqa: ASYNC251 - one turn of 60 ms: the tick due in it runs late
    await asyncio.sleep(0.03)
    clock.release()
    clock.unwatch(watcher)
    clock.unwatch(watcher)  # a second unwatch is a no-op, not a second release
    seen = len(ticks)
    await asyncio.sleep(0.05 + COARSE_TICK_S)
    assert not clock.ticking  # its next tick found nobody
    assert len(ticks) == seen
    assert seen >= 4
    assert max(late for late, _ in ticks) >= 0.03
    assert all(a[1] < b[1] for a, b in itertools.pairwise(ticks))


async def test_a_watcher_that_raises_is_reported_once_and_dropped_and_the_clock_ticks_on() -> None:
    loop = asyncio.get_running_loop()
    clock = LoopLag.of(loop)
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    calls = {"first": 0, "bad": 0, "good": 0}

    def first(late: float, now: float) -> None:
        calls["first"] += 1

    def bad(late: float, now: float) -> None:
        calls["bad"] += 1
        raise ValueError("broken")

    def good(late: float, now: float) -> None:
        calls["good"] += 1

    try:
        clock.watch(loop, first)
        clock.watch(loop, bad)
        clock.watch(loop, good)
        await asyncio.sleep(COARSE_TICK_S * 2.5)
        with pytest.raises(TimeoutError):  # the clock still serves the bounds
            async with Bound(0.02):
                await asyncio.sleep(30)
        clock.unwatch(good)
        clock.unwatch(first)
    finally:
        loop.set_exception_handler(None)
    assert calls["bad"] == 1 and len(reported) == 1
    assert isinstance(reported[0]["exception"], ValueError)
    # The watcher after it was called at every tick, the one it raised in too.
    assert calls["good"] == calls["first"] >= 3


def test_a_closed_loop_is_not_kept_alive_by_a_watched_clock() -> None:
    """A watcher that outlives its loop (never unwatched) keeps neither alive."""

    class Probe:
        def sample(self, late: float, now: float) -> None:
            pass

    async def watched() -> None:
        loop = asyncio.get_running_loop()
        LoopLag.of(loop).watch(loop, Probe().sample)
        await asyncio.sleep(0.02)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(watched())
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None


async def test_a_cancellation_from_elsewhere_passes_through_the_bound() -> None:
    async def waits() -> None:
        async with Bound(5.0):
            await asyncio.sleep(30)

    task = asyncio.create_task(waits())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_inner_bound_that_expires_first_is_the_one_that_raises() -> None:
    with pytest.raises(TimeoutError):
        async with Bound(5.0) as outer, Bound(0.02):
            await asyncio.sleep(30)
    # The outer bound saw a TimeoutError pass, not a cancellation of its own.
    assert not outer._expired

    async def outer_first() -> None:
        async with Bound(0.02), Bound(5.0):
            await asyncio.sleep(30)

    with pytest.raises(TimeoutError):
        await outer_first()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_loop_busy_in_short_turns_gives_back_only_a_small_share() -> None:
    # Turns of 1 ms keep time: timers run within a turn or two. The lag given back is how
    # late the clock's ticks ran, a fraction of the bound, not every busy turn (which would
    # stretch each bound to MAX_STRETCH times its length under ordinary load).
    loop = asyncio.get_running_loop()
    neighbour = asyncio.create_task(backlog(0.001, 20.0))
    started = loop.time()
    try:
        with pytest.raises(TimeoutError):
            async with Bound(0.1) as bound:
                await loop.create_future()
    finally:
        neighbour.cancel()
    elapsed = loop.time() - started
    assert bound.lag_s < 0.5 * elapsed, (bound.lag_s, elapsed)


def test_a_closed_loop_is_not_kept_alive_by_its_clock() -> None:
    async def bounded() -> None:
        async with Bound(1.0):
            await asyncio.sleep(0)  # closed while its clock's tick is still pending

    loops = []
    for _ in range(3):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(bounded())
        loop.close()
        loops.append(weakref.ref(loop))
        del loop
    gc.collect()
    assert [ref() for ref in loops] == [None, None, None]


async def test_a_bound_is_entered_once_and_a_bad_length_holds_no_clock() -> None:
    bound = Bound(1.0)
    async with bound:
        with pytest.raises(RuntimeError):
            async with bound:
                pass
    clock = LoopLag.of(asyncio.get_running_loop())
    await asyncio.sleep(COARSE_TICK_S + 0.05)  # the clock's last tick
    assert not clock.ticking
    with pytest.raises(TypeError):
        async with Bound("0.1"):  # type: ignore[arg-type]
            pass
    await asyncio.sleep(COARSE_TICK_S + 0.05)
    assert not clock.ticking


class ScriptedTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedLoop:
    """Just what the lag clock asks of a loop: the time, and timers (recorded, not run)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[float] = []
        self.handles: list[ScriptedTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: object, *args: object) -> ScriptedTimer:
        self.timers.append(when)
        self.handles.append(ScriptedTimer())
        return self.handles[-1]


def test_the_later_a_tick_runs_the_sooner_the_next_so_the_stretch_grows_smoothly() -> None:
    # The gap to the next tick is TICK_S squared over TICK_S plus the lateness: 10 ms on time,
    # 5 ms at 10 ms late, 2 ms at 40 ms late. A long turn gives a bound about that gap, so
    # a bound stretches by the turns' length smoothly, not in a jump at some lateness.
    loop = ScriptedLoop()
    clock = LoopLag()
    clock.hold(loop, 0.0)  # type: ignore[arg-type]
    assert loop.timers == [pytest.approx(TICK_S)]
    gaps = []
    for late in (0.0, 0.005, 0.01, 0.04):
        loop.now = loop.timers[-1] + late
        tick(clock, loop)
        gaps.append(loop.timers[-1] - loop.now)
    assert gaps == [pytest.approx(g) for g in (0.01, 0.01 / 1.5, 0.005, 0.002)]
    assert clock.summed(loop.now) == pytest.approx(0.055)
    clock.release()
    loop.now = loop.timers[-1]
    tick(clock, loop)
    assert not clock.ticking


def tick(clock: LoopLag, loop: ScriptedLoop) -> None:
    """The clock's pending tick runs (at ``loop.now``)."""
    clock._tick(loop)  # type: ignore[arg-type]


def test_at_rest_the_clock_ticks_coarsely_and_work_that_needs_it_fine_hurries_it_at_once() -> None:
    """Only a watcher and a long bound (the lag probe, a listener's long poll): a tick every
    COARSE_TICK_S. A request (a fine hold) or a short bound brings the next tick within
    TICK_S, and the coarse tick's timer is cancelled; once they are released, coarse again."""
    loop = ScriptedLoop()
    clock = LoopLag()
    clock.hold(loop, 0.0, fine=False)  # type: ignore[arg-type]
    assert loop.timers == [pytest.approx(COARSE_TICK_S)] and not clock.fine
    loop.now = COARSE_TICK_S
    tick(clock, loop)
    assert loop.timers[-1] - loop.now == pytest.approx(COARSE_TICK_S)
    coarse = loop.handles[-1]
    loop.now += 0.03
    clock.hold(loop, loop.now)  # type: ignore[arg-type]  # a request comes
    assert clock.fine and loop.timers[-1] - loop.now == pytest.approx(TICK_S)
    assert coarse.cancelled  # it will not wake the loop
    loop.now = loop.timers[-1]
    tick(clock, loop)
    assert loop.timers[-1] - loop.now == pytest.approx(TICK_S)
    assert clock.summed(loop.now) == 0.0
    timers = len(loop.timers)
    clock.hold(loop, loop.now)  # type: ignore[arg-type]  # a second fine holder: no new tick
    assert len(loop.timers) == timers
    clock.release()
    clock.release()  # the requests are answered
    loop.now = loop.timers[-1]
    tick(clock, loop)
    assert not clock.fine and loop.timers[-1] - loop.now == pytest.approx(COARSE_TICK_S)
    clock.release(fine=False)
    loop.now = loop.timers[-1]
    tick(clock, loop)
    assert not clock.ticking


async def test_a_short_bound_ticks_the_clock_finely_and_a_long_one_coarsely() -> None:
    clock = LoopLag.of(asyncio.get_running_loop())
    async with Bound(FINE_UNDER_S):
        assert clock.ticking and not clock.fine  # a long poll's, a Redis command's
        async with Bound(FINE_UNDER_S / 10):  # a stage's budget
            assert clock.fine
        assert not clock.fine
    await asyncio.sleep(COARSE_TICK_S * 1.5)
    assert not clock.ticking


async def test_on_a_real_loop_a_resting_clock_wakes_it_ten_times_less_often() -> None:
    """The gaps between the ticks a watcher sees: about COARSE_TICK_S with a long bound open
    alone, about TICK_S while a request is served. Medians, with loose limits: a stall of the
    process makes one long gap, and a late tick makes the next one sooner."""
    loop = asyncio.get_running_loop()
    clock = LoopLag.of(loop)
    ticks: list[float] = []

    def watcher(late: float, now: float) -> None:
        ticks.append(now)

    clock.watch(loop, watcher)
    try:
        async with Bound(5.0):
            await asyncio.sleep(COARSE_TICK_S * 6)
            resting = list(ticks)
            clock.hold(loop, loop.time())
            try:
                await asyncio.sleep(COARSE_TICK_S * 3)
            finally:
                clock.release()
            serving = ticks[len(resting) :]
    finally:
        clock.unwatch(watcher)
    rest_gap = statistics.median(b - a for a, b in itertools.pairwise(resting))
    serve_gap = statistics.median(b - a for a, b in itertools.pairwise(serving))
    assert rest_gap >= COARSE_TICK_S / 2, resting
    assert serve_gap <= TICK_S * 3, serving


async def test_a_bound_releases_the_clock_as_it_held_it_whatever_its_seconds_become() -> None:
    """The length decides a fine or coarse hold at the entry; changed inside the block (to
    another length, or None), the exit still releases that hold, once."""
    clock = LoopLag.of(asyncio.get_running_loop())
    for changed in (FINE_UNDER_S / 10, None):
        bound = Bound(FINE_UNDER_S * 2)
        async with bound:
            bound.seconds = changed
        assert not clock.fine
        await asyncio.sleep(COARSE_TICK_S * 1.5)
        assert not clock.ticking, changed
