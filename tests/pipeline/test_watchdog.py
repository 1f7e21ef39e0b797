"""The watchdog: ``asyncio.timeout_at``'s effect on each await it bounds, one timer for many."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.watchdog import Watchdog


def counting_timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times of the timers the running loop is asked to make from now on."""
    loop = asyncio.get_running_loop()
    made: list[float] = []
    call_at = loop.call_at

    def counted(when: float, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(when)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted)
    return made


async def test_an_await_past_its_bound_raises_timeout_and_leaves_the_task_uncancelled() -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()
    started = loop.time()
    with pytest.raises(TimeoutError), watchdog.until(started + 0.05):
        await asyncio.sleep(5)
    assert 0.04 <= loop.time() - started < 1.0
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    # The watchdog goes on bounding later awaits.
    with watchdog.until(loop.time() + 1):
        await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError), watchdog.until(loop.time() + 0.02):
        await asyncio.sleep(5)
    watchdog.close()


async def test_many_short_awaits_share_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    made = counting_timers(monkeypatch)
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()
    for _ in range(200):
        with watchdog.until(loop.time() + 30):
            await asyncio.sleep(0)
    assert len(made) == 1, made
    with watchdog.until(None):  # no bound: no timer
        await asyncio.sleep(0)
    assert len(made) == 1
    watchdog.close()


async def test_a_timer_made_for_an_earlier_await_moves_to_the_await_in_progress() -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()
    with watchdog.until(loop.time() + 0.05):
        await asyncio.sleep(0)  # over at once; the timer stays, for 50 ms from now
    started = loop.time()
    with watchdog.until(started + 0.3):
        await asyncio.sleep(0.15)  # outlives the first timer, not its own bound
    with pytest.raises(TimeoutError), watchdog.until(loop.time() + 0.05):
        await asyncio.sleep(5)
    # An earlier bound than the timer's moves the timer back.
    with watchdog.until(loop.time() + 10):
        await asyncio.sleep(0)
    started = loop.time()
    with pytest.raises(TimeoutError), watchdog.until(started + 0.05):
        await asyncio.sleep(5)
    assert loop.time() - started < 1.0
    watchdog.close()


async def test_a_cancellation_from_elsewhere_is_not_taken_for_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()

    async def bounded() -> None:
        with watchdog.until(loop.time() + 10):
            await asyncio.sleep(5)

    task = asyncio.create_task(bounded())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watchdog.close()


async def test_awaits_in_different_tasks_are_each_bounded() -> None:
    # A stream's first read is the request handler's, the rest the response writer's.
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()

    async def read(seconds: float, bound: float) -> str:
        try:
            with watchdog.until(loop.time() + bound):
                await asyncio.sleep(seconds)
        except TimeoutError:
            return "timed out"
        return "read"

    assert await asyncio.create_task(read(0.01, 0.2)) == "read"
    assert await asyncio.create_task(read(5, 0.05)) == "timed out"
    assert await read(0.01, 0.2) == "read"
    assert await asyncio.create_task(read(5, 0.05)) == "timed out"
    watchdog.close()


async def test_close_leaves_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog()
    with watchdog.until(loop.time() + 30):
        await asyncio.sleep(0)
    timer = watchdog._timer
    assert timer is not None
    watchdog.close()
    assert timer.cancelled() and watchdog._timer is None
