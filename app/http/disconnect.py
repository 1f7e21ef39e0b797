"""A call queued for a route's slot whose client has left leaves the queue.

uvicorn does not cancel a request's task when its client closes the connection: a call queued
for a slot (``pipeline.model.slots``) would wait its turn, take the slot and start a generation
whose first write then fails, so a burst of clients that give up while queued (their own
timeouts, a load balancer's) would still cost the model server one call each. While the
pipeline runs, ``slots.caller_left`` holds a wait for the client's leaving, which a queued call
races against its turn (and only a queued call: one that finds a slot pays nothing).

Only the queue wait is cut short. A generation already under way goes on as it did (a plain
answer is finished and cached, so a retry finds it, and followers of a shared generation are
not cut off); once a streamed answer has started, the response itself notices the client's
leaving (``app.http.streaming``).

The body has been read by then, so the next ASGI message is ``http.disconnect``, whenever the
client goes (uvicorn; the test transports send it only once the response is complete).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from starlette.types import Receive

from pipeline.model.slots import caller_left


@contextmanager
def queued_calls_leave_with(receive: Receive) -> Iterator[None]:
    """Within the block, a call of this request queued for a slot leaves the queue when the
    client disconnects (``receive``: the request's, its body already read)."""
    token = caller_left.set(partial(_disconnected, receive))
    try:
        yield
    finally:
        caller_left.reset(token)


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected; waits for ever if that cannot be told."""
    try:
        message = await receive()
    except Exception:  # a server that has no such message: nothing to watch
        message = {}
    if message.get("type") != "http.disconnect":
        await asyncio.get_running_loop().create_future()
