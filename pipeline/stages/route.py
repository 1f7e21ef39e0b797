"""The route stage: which model route answers this request, and why.

The router's rules settle most requests from their words and the user's features; only what
they leave open needs the query's embedding, taken from retrieval when it computed one, else
embedded here (through the app's query batcher). Routing is an optimisation, so it degrades:
when it fails or runs past its budget, the default route answers and the reason says why.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from pipeline.context import RequestContext, RouteChoice
from pipeline.errors import PipelineError
from pipeline.model.messages import last_user_text
from pipeline.model.salt import MemoScope
from pipeline.routing.load import SMALL_ROUTE, LoadPolicy
from pipeline.routing.router import Router
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr
from pipeline.telemetry import metrics
from retrieval.embeddings import EmbedQuery

OFFLOAD_CHARS = 8192


class ChooseRoute:
    """Sets ``ctx.route`` (``rag.route`` and ``rag.route.reason`` on the span).

    ``embed`` embeds the query when retrieval did not; ``with_features`` and
    ``with_query_vector`` say whether the path has the stages that write those fields (they
    run before this one, so there is nothing to wait for)."""

    def __init__(
        self,
        router: Router,
        *,
        embed: EmbedQuery | None = None,
        with_features: bool = False,
        with_query_vector: bool = False,
        timeout_s: float | None = None,
        load: LoadPolicy | None = None,
        memo_scope: MemoScope,
    ) -> None:
        if router.centroids is not None and embed is None:
            raise ValueError("a router with centroids needs an embed function")
        self.router = router
        self.embed = embed
        # Callers of one memo scope waiting for the same text share one embedding.
        self.memo_scope = memo_scope
        # Under load, the small route instead of a loaded one (pipeline.routing.load).
        self.load = load
        optional = {"features": with_features, "query_vector": with_query_vector}
        self.spec = StageSpec.of(
            "route",
            reads={
                "params",
                *(name for name, on in optional.items() if on),
                # The memo scope: its callers waiting for one text share one embedding.
                *(["principal"] if load is not None or embed is not None else []),
            },
            optional=optional.keys(),  # read all the same: their defaults when not on the path
            writes={"route", *(["cache_control"] if load is not None else [])},
            policy="degrade",
            timeout_s=timeout_s,
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        # The rules read the whole question: a long one (40,000 characters took 40-100 ms to
        # classify) is decided in a worker thread, off the event loop.
        if len(last_user_text(ctx.params.messages)) > OFFLOAD_CHARS:
            choice = await asyncio.to_thread(self.router.decide, ctx.params, ctx.features)
        else:
            choice = self.router.decide(ctx.params, ctx.features)
        if choice is None:
            centroids = self.router.centroids
            if centroids is not None and not centroids.ready:
                await asyncio.to_thread(centroids.warm_up)  # not warmed at start-up
            vector = ctx.query_vector
            if vector is None:
                assert self.embed is not None  # checked in __init__
                text = last_user_text(ctx.params.messages)
                vector = await self.embed(text, scope=self.memo_scope(ctx.caller))
            choice = self.router.by_vector(ctx.params, vector)
        self._take(ctx, self._relieve(ctx, choice) if self.load is not None else choice)
        return ctx

    def _relieve(self, ctx: RequestContext, choice: RouteChoice) -> RouteChoice:
        """The small route instead of ``choice`` when its route is loaded to the last step
        and the small one, a route this request may take, is less loaded."""
        assert self.load is not None
        routes = self.router.routes
        small = routes.routes.get(self.router.policy.intents.get("small", "small"))
        if small is None or small.name == choice.name:
            return choice
        if small not in routes.candidates(ctx.params.model, ctx.params.rag.route):
            return choice  # pinned elsewhere, or a model the small route does not serve
        tenant = ctx.caller.tenant
        level = routes.get(choice.name).slots.pressure(tenant)
        if SMALL_ROUTE not in self.load.steps(level) or small.slots.pressure(tenant) >= level:
            return choice
        metrics.adapted(SMALL_ROUTE)
        ctx.cache_control = replace(ctx.cache_control, no_store=True)
        ctx.annotate(
            **{
                attr.ADAPT_PRESSURE: round(level, 3),
                attr.ADAPT_STEPS: [SMALL_ROUTE],
                attr.ADAPT_ROUTE: f"{choice.name}->{small.name}",
            }
        )
        return RouteChoice(small.name, small.model, f"{choice.reason};adapted:load")

    def fallback(self, ctx: RequestContext, exc: Exception) -> None:
        """The default route, with the failure as the reason."""
        route = self.router.routes.first_choice(ctx.params.model, ctx.params.rag.route)
        self._take(ctx, RouteChoice(route.name, route.model, f"fallback:{describe(exc)}"))

    @staticmethod
    def _take(ctx: RequestContext, choice: RouteChoice) -> None:
        ctx.route = choice
        ctx.annotate(**{attr.ROUTE: choice.name, attr.ROUTE_REASON: choice.reason})


def describe(exc: Exception) -> str:
    """A short reason: the error's type and the start of its message."""
    message = exc.message if isinstance(exc, PipelineError) else str(exc)
    message = " ".join(message.split())
    if len(message) > 80:
        message = message[:77] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
