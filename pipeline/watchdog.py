"""A time bound on many short awaits in a row, at the cost of a few attribute writes each.

A streamed answer awaits twice per token under a bound: the read of the model server's next
chunk (the request's deadline) and the write of the chunk to the client (the write-stall limit).
``asyncio.timeout`` or an anyio ``CancelScope`` around each makes a timer and cancels it again,
per token: a tenth of what the service spent relaying a token in a profile. Nearly every one
of those awaits is over long before its bound, so one timer for the whole stream serves: it is
made at the first bound and, when it fires early (the await it was made for is over), moved to
the bound of the await then in progress, or left unmade until the next one begins.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Final


class Watchdog:
    """``with watchdog.until(at):`` around one await: if the await is still in progress at
    ``at`` (event-loop time; None: no bound), its task is cancelled and the block raises
    ``TimeoutError``, as ``asyncio.timeout_at(at)`` would; a cancellation from elsewhere
    passes through as it is. The awaits may be in different tasks (a stream's first read is
    the request handler's, the rest the response writer's), one at a time. ``close()`` when
    the stream ends, so no timer outlives it."""

    __slots__ = ("_at", "_cancelling", "_expired", "_loop", "_pending", "_task", "_timer")

    def __init__(self) -> None:
        self._loop: Final = asyncio.get_running_loop()
        self._task: asyncio.Task[object] | None = None
        self._at: float | None = None  # the bound of the await in progress, if any
        self._pending: float | None = None  # the bound of the next block entered
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelling = 0

    def until(self, at: float | None) -> Watchdog:
        if self._at is not None:
            raise RuntimeError("a watchdog bounds one await at a time")
        self._pending = at
        return self

    def __enter__(self) -> Watchdog:
        at = self._pending
        if at is None:
            return self
        task = asyncio.current_task()
        assert task is not None, "a watchdog bounds awaits of a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._at = at
        timer = self._timer
        if timer is None or timer.when() > at:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(at, self._fire)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._at = None
        if not self._expired:
            return
        self._expired = False
        assert self._task is not None
        if self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from error

    def _fire(self) -> None:
        self._timer = None
        at = self._at
        if at is None:
            return  # no await in progress: the next one makes the timer again
        if self._loop.time() < at:
            self._timer = self._loop.call_at(at, self._fire)  # made for an earlier await
            return
        assert self._task is not None
        self._expired = True
        self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
