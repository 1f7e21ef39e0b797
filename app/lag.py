"""The event loop's lag: how late the loop's clock ticks run.

Every request of a process shares one event loop, so anything CPU-heavy that runs on it (a
regex that backtracks, a large body parsed inline) delays every other request by as long. The
probe makes that visible: it watches the loop's clock (``pipeline.looptime.LoopLag``, which
ticks every 10 ms while a request is served and every 100 ms at rest, while the loop keeps
time, and sooner after a late tick), records how late
each tick ran (``rag_event_loop_lag_seconds``, a histogram), and keeps the largest lag seen so
far (``max_lag``), which the tests read around a heavy request. Another process (the load
benchmark) reads the worst lag of the last ``WINDOW_S`` to twice that from
``rag_event_loop_lag_max_seconds`` (polled more often than ``WINDOW_S``, no peak is missed;
Prometheus has the histogram). The probe has no timer of its own: the time bounds
(``pipeline.looptime.Bound``) read the same ticks, so the loop wakes once per tick for both.
"""

from __future__ import annotations

import asyncio

from pipeline.looptime import LoopLag
from pipeline.telemetry.metrics import EVENT_LOOP_LAG, EVENT_LOOP_LAG_MAX

WINDOW_S = 2.0


class LagProbe:
    """Measures the loop's lag from ``start()`` (on the loop) until ``stop()``."""

    def __init__(self, *, record: bool = True, window_s: float = WINDOW_S) -> None:
        self.record = record
        self.window_s = window_s
        self.max_lag = 0.0
        self.samples = 0
        self._clock: LoopLag | None = None
        self._watcher = self._sample  # one object: the clock unwatches by identity
        self._window_ends = 0.0
        self._worst = 0.0  # this window's
        self._previous = 0.0  # the last window's

    def start(self) -> LagProbe:
        if self._clock is not None:
            raise RuntimeError("the lag probe is already started")
        loop = asyncio.get_running_loop()
        self._window_ends = loop.time() + self.window_s
        self._clock = LoopLag.of(loop)
        self._clock.watch(loop, self._watcher)
        return self

    def reset(self) -> float:
        """The largest lag since the last reset (or the start), and start again from 0."""
        lag, self.max_lag = self.max_lag, 0.0
        return lag

    def _sample(self, lag: float, now: float) -> None:
        self.samples += 1
        self.max_lag = max(self.max_lag, lag)
        if self.record:
            EVENT_LOOP_LAG.observe(lag)
            if now >= self._window_ends:
                self._window_ends, self._previous, self._worst = (
                    now + self.window_s,
                    self._worst,
                    0.0,
                )
            self._worst = max(self._worst, lag)
            EVENT_LOOP_LAG_MAX.set(max(self._worst, self._previous))

    async def stop(self) -> None:
        if self._clock is not None:
            self._clock.unwatch(self._watcher)
            self._clock = None
