"""The adapt stage: under load, the request asks for fewer and shorter sources
(``pipeline.routing.load``); the small route, the last step, is the route stage's.

It runs after the cache lookup (a hit needs no model) and before retrieval, whose ``top_k``
and the compression after it are what it changes: it writes a new ``params`` with the reduced
``rag`` options, and marks the answer not to be stored (``cache_control``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeline.context import RequestContext
from pipeline.model.routes import RouteTable
from pipeline.routing.load import COMPRESS, TOP_K, LoadPolicy, pressure
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr
from pipeline.telemetry import metrics


class AdaptToLoad:
    """``budget_tokens`` and ``compress``: the server's compression budget and switch (what a
    request that sets neither gets)."""

    spec = StageSpec.of("adapt", reads={"params", "principal"}, writes={"params", "cache_control"})

    def __init__(
        self,
        routes: RouteTable,
        policy: LoadPolicy,
        *,
        budget_tokens: int,
        compress: bool = True,
    ) -> None:
        self.routes = routes
        self.policy = policy
        self.budget_tokens = budget_tokens
        self.compress = compress

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        options = ctx.params.rag
        candidates = self.routes.candidates(ctx.params.model, options.route)
        level = pressure(candidates, ctx.caller.tenant)
        ctx.annotate(**{attr.ADAPT_PRESSURE: round(level, 3)})
        steps = self.policy.steps(level)
        if not options.enabled or not steps:
            return ctx
        changes: dict[str, Any] = {}
        if TOP_K in steps and options.top_k > self.policy.top_k:
            changes["top_k"] = self.policy.top_k
        if COMPRESS in steps:
            compressing = self.compress if options.compress is None else options.compress
            budget = options.budget_tokens or self.budget_tokens
            if not compressing or budget > self.policy.budget_tokens:
                changes["compress"] = True
                changes["budget_tokens"] = min(budget, self.policy.budget_tokens)
        if not changes:
            return ctx
        taken = [s for s in (TOP_K, COMPRESS) if s in steps and _changed(s, changes)]
        ctx.params = replace(ctx.params, rag=replace(options, **changes))
        # The cache key describes the request as asked: an answer to less is not stored.
        ctx.cache_control = replace(ctx.cache_control, no_store=True)
        for step in taken:
            metrics.adapted(step)
        ctx.annotate(
            **{
                attr.ADAPT_STEPS: taken,
                attr.ADAPT_TOP_K: changes.get("top_k"),
                attr.ADAPT_BUDGET: changes.get("budget_tokens"),
            }
        )
        return ctx


def _changed(step: str, changes: dict[str, Any]) -> bool:
    return ("top_k" if step == TOP_K else "budget_tokens") in changes
