"""The lag probe's worst-lag gauge: what another process polling /metrics reads as the loop's
worst lag of the last few seconds."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from app.lag import LagProbe
from pipeline.looptime import LoopLag


def serving(loop: asyncio.AbstractEventLoop) -> None:
    """Hold the loop's clock as the app does while it serves a request (release it after)."""
    LoopLag.of(loop).hold(loop, loop.time())


def worst_lag() -> float:
    value = REGISTRY.get_sample_value("rag_event_loop_lag_max_seconds")
    assert value is not None
    return value


def test_the_worst_lag_gauge_shows_a_stall_for_a_window_or_two_then_forgets_it() -> None:
    async def main() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        probe = LagProbe(window_s=0.2).start()
        serving(loop)  # a request is served: the clock ticks every 10 ms
        await asyncio.sleep(0.05)
        time.sleep(0.15)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.05)
        seen = worst_lag()
        # Forgotten once two whole windows pass without a stall as long. On a loaded machine
        # the loop may itself be left unscheduled for a while (a stall of its own, which the
        # gauge rightly shows for its windows), so wait for the drop rather than for 0.6 s;
        # a gauge that never forgot would keep `seen` (>= 0.14 s) and time out here.
        started = time.monotonic()
        while (later := worst_lag()) >= seen and time.monotonic() - started < 30:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        LoopLag.of(loop).release()
        await probe.stop()
        return seen, later, time.monotonic() - started

    seen, later, waited = asyncio.run(main())
    assert seen >= 0.12  # a lower bound: a loaded machine only makes the stall look longer
    assert later < seen, f"the stall still showed {waited:.0f} s (150 windows) after it ended"


def test_the_probe_reads_the_clock_the_time_bounds_use_with_no_timer_of_its_own() -> None:
    """One clock wakes the loop for both: the probe's samples are that clock's ticks, it keeps
    the clock ticking while no bound is open, and stopping it stops the clock."""
    import asyncio

    from pipeline.looptime import LoopLag

    async def main() -> tuple[bool, int, bool, int]:
        loop = asyncio.get_running_loop()
        clock = LoopLag.of(loop)
        probe = LagProbe(record=False).start()
        scheduled = len(loop._scheduled)  # type: ignore[attr-defined]  # asyncio's timers
        await asyncio.sleep(0.15)
        ticking = clock.ticking
        await probe.stop()
        counted = probe.samples
        await asyncio.sleep(0.15)
        return ticking, counted, clock.ticking, scheduled

    ticking, counted, still_ticking, scheduled = asyncio.run(main())
    assert scheduled == 1  # the clock's next tick, and nothing of the probe's own
    assert ticking and not still_ticking
    assert counted >= 1  # one tick every 0.1 s at rest


def test_a_probe_is_started_once() -> None:
    """A second start would watch the clock twice and one stop leave it ticking for good."""
    import asyncio

    import pytest

    async def main() -> None:
        probe = LagProbe(record=False).start()
        with pytest.raises(RuntimeError):
            probe.start()
        await probe.stop()
        await probe.stop()  # a second stop is a no-op

    asyncio.run(main())


def test_the_clock_ticks_finely_while_a_request_is_served_and_coarsely_after() -> None:
    """``RequestTracing`` (the outermost middleware) holds the clock fine for the request's
    whole life, a stream's last byte included; at rest it ticks every COARSE_TICK_S."""
    import httpx
    from opentelemetry import trace
    from starlette.types import Receive, Scope, Send

    from app.http.middleware import RequestTracing

    seen: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        clock = LoopLag.of(asyncio.get_running_loop())
        seen.append(clock.fine)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append(clock.fine)
        await send({"type": "http.response.body", "body": b"b"})

    async def main() -> tuple[bool, bool]:
        clock = LoopLag.of(asyncio.get_running_loop())
        served = RequestTracing(app, tracer=trace.get_tracer("test"))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=served), base_url="http://test"
        ) as client:
            assert (await client.get("/")).text == "ab"
        return clock.fine, clock.ticking

    fine_after, ticking = asyncio.run(main())
    assert seen == [True, True]
    assert not fine_after and ticking  # it runs on to its next tick, then stops
