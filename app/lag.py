"""The event loop's lag: how late a task that sleeps 10 ms wakes up.

Every request of a process shares one event loop, so anything CPU-heavy that runs on it (a
regex that backtracks, a large body parsed inline) delays every other request by as long. The
probe makes that visible: it sleeps ``interval`` seconds, records how much later than asked it
woke (``rag_event_loop_lag_seconds``, a histogram), and keeps the largest lag seen so far
(``max_lag``), which the tests read around a heavy request. Another process (the load benchmark)
reads the worst lag of the last ``WINDOW_S`` to twice that from ``rag_event_loop_lag_max_seconds``
(polled more often than ``WINDOW_S``, no peak is missed; Prometheus has the histogram).
"""

from __future__ import annotations

import asyncio
import contextlib

from pipeline.telemetry.metrics import EVENT_LOOP_LAG, EVENT_LOOP_LAG_MAX

WINDOW_S = 2.0


class LagProbe:
    """A task measuring the loop's lag until ``stop()``."""

    def __init__(
        self, interval: float = 0.01, *, record: bool = True, window_s: float = WINDOW_S
    ) -> None:
        self.interval = interval
        self.record = record
        self.window_s = window_s
        self.max_lag = 0.0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lag-probe")
        return self

    def reset(self) -> float:
        """The largest lag since the last reset (or the start), and start again from 0."""
        lag, self.max_lag = self.max_lag, 0.0
        return lag

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        window_ends, worst, previous = loop.time() + self.window_s, 0.0, 0.0
        while True:
            asked = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            lag = max(0.0, now - asked)
            self.samples += 1
            self.max_lag = max(self.max_lag, lag)
            if self.record:
                EVENT_LOOP_LAG.observe(lag)
                if now >= window_ends:
                    window_ends, previous, worst = now + self.window_s, worst, 0.0
                worst = max(worst, lag)
                EVENT_LOOP_LAG_MAX.set(max(worst, previous))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
