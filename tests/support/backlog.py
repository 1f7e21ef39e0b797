"""A backlogged event loop, as a burst of requests in one process makes it: every turn of the
loop takes at least ``turn_s``, in slices of synchronous work between which the loop runs its
timers and I/O (unlike a single stall)."""

from __future__ import annotations

import asyncio
import time


async def backlog(turn_s: float, for_s: float) -> int:
    """Blocks the loop for ``turn_s`` once per turn, for about ``for_s``; the number of turns."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + for_s
    turns = 0
    while loop.time() < ends:
        time.sleep(turn_s)  # noqa: ASYNC251 - the backlog under test
        turns += 1
        await asyncio.sleep(0)
    return turns
