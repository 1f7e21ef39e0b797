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
    async def main() -> tuple[float, float]:
        probe = LagProbe(window_s=0.2).start()
        await asyncio.sleep(0.05)
        time.sleep(0.15)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.05)
        seen = worst_lag()
        await asyncio.sleep(0.6)  # two whole windows without a stall
        later = worst_lag()
        await probe.stop()
        return seen, later

    seen, later = asyncio.run(main())
    assert seen >= 0.12
    assert later < seen  # a generous bound: the machine is shared; the stall itself is gone
