"""Rate limits at the edge: every authenticated /v1 request is admitted or refused (429) before
its body is read, and every answer carries the ``x-ratelimit-*`` headers. Where a token limit
applies, the chat route then holds the request's estimated tokens (``reserve``), refused with
the same 429 while the window is full.

``RateLimits`` is the ASGI middleware just inside ``AuthenticateFirst`` (it reads the principal
that one resolved). The tokens of an answer are charged after it (``charge``): the chat route
calls it when a generated answer is complete, streamed or not; a cache hit costs no tokens.
"""

from __future__ import annotations

import asyncio
from typing import Final

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.auth import PRINCIPAL, refuse
from app.services import Services
from pipeline.context import Principal
from pipeline.store.limits import Decision, Reservation, refusal

DEGRADED: Final = "rag.ratelimit.degraded"
# In the scope's state: (key id, Decision) of a request the cache fast path admitted and then
# left to the full path, so that it is not admitted (counted) twice.
ADMITTED: Final = "rag.ratelimit.admitted"
_settling: set[asyncio.Task[None]] = set()  # charges in flight (kept from the collector)


class RateLimits:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal: Principal | None = scope.get("state", {}).get(PRINCIPAL)
        # A principal was resolved, so the app's services are up (auth used them).
        services: Services | None = scope["app"].state.services if principal else None
        limiter = services.limits if services is not None else None
        if principal is None or limiter is None:
            await self.app(scope, receive, send)
            return
        earlier = scope["state"].pop(ADMITTED, None)
        if earlier is not None and earlier[0] == principal.key_id:
            decision = earlier[1]  # the fast path's, annotated there
        else:
            decision = await limiter.admit(principal)
            annotate_limits(decision)
        if not decision.admitted:
            await refuse(send, refusal(decision, limiter.config.window_seconds))
            return
        headers = [(name.encode(), value.encode()) for name, value in decision.headers().items()]
        if not headers:
            await self.app(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                # A refusal after admission (the chat route's reservation of tokens) has its
                # own, newer headers: those stand (both were sent, with different values).
                given = message.get("headers", [])
                own = {name for name, _ in given}
                message["headers"] = [*given, *(h for h in headers if h[0] not in own)]
            await send(message)

        await self.app(scope, receive, send_with_limits)


def annotate_limits(decision: Decision) -> None:
    """The limiter's decision on the request's span: degraded, what remains, what refused."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    if decision.degraded:
        span.set_attribute(DEGRADED, True)
    for usage in decision.usages:
        if usage.limit > 0:
            span.set_attribute(
                f"rag.ratelimit.{usage.scope}.{usage.kind}.remaining", usage.remaining
            )
    if decision.refused is not None:
        span.set_attribute(
            "rag.ratelimit.refused", f"{decision.refused.scope}.{decision.refused.kind}"
        )


async def reserve(services: Services, principal: Principal, tokens: int) -> Reservation | None:
    """Hold a request's estimated ``tokens`` in its key's and tenant's token windows (once its
    body is read), or raise the 429 that says which limit is spent; None where no token limit
    applies, or Redis cannot be asked and the limiter fails open."""
    limiter = services.limits
    if limiter is None:
        return None
    decision, reservation = await limiter.reserve(principal, tokens)
    if not decision.admitted:
        annotate_limits(decision)
        raise refusal(decision, limiter.config.window_seconds)
    return reservation


def charge(
    services: Services, principal: Principal, tokens: int, reservation: Reservation | None = None
) -> None:
    """Charge an answer's tokens to its key and tenant in place of its ``reservation``, in the
    background, so that no answer waits for it (a stream its client cut short included: what
    it spent until then, ``pipeline.model.spend``)."""
    if services.limits is None or (tokens <= 0 and reservation is None):
        return
    settling = services.limits.settle(principal, tokens, reservation)
    task = asyncio.get_running_loop().create_task(settling)
    _settling.add(task)
    task.add_done_callback(_settling.discard)
