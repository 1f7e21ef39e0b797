"""The lag probe's worst-lag gauge: what another process polling /metrics reads as the loop's
worst lag of the last few seconds."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from app.lag import LagProbe


def worst_lag() -> float:
    value = REGISTRY.get_sample_value("rag_event_loop_lag_max_seconds")
    assert value is not None
    return value


def test_the_worst_lag_gauge_shows_a_stall_for_a_window_or_two_then_forgets_it() -> None:
    async def main() -> tuple[float, float, float]:
        probe = LagProbe(window_s=0.2).start()
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
        await asyncio.sleep(0.1)
        ticking = clock.ticking
        await probe.stop()
        counted = probe.samples
        await asyncio.sleep(0.05)
        return ticking, counted, clock.ticking, scheduled

    ticking, counted, still_ticking, scheduled = asyncio.run(main())
    assert scheduled == 1  # the clock's next tick, and nothing of the probe's own
    assert ticking and not still_ticking
    assert counted >= 3  # about 10 in 0.1 s; fewer only on a machine that stalls the process


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
