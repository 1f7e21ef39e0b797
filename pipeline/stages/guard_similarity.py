"""The second input guardrail: how close the question's embedding is to known injection attacks.

It runs in the concurrent group beside retrieval, and uses the query vector retrieval computes
anyway (embedding it itself only when retrieval did not), so it costs no embedding of its own on
the usual path and nothing at all on a cache hit: a cached answer's key holds the exact text
and the guard policy, so that text passed this check before. A flagged request fails the group
(a refusal ends the request under any policy), which cancels its siblings, before any answer is
generated. The stage degrades on faults: should the embedding model fail, the rules (`guard_in`)
have judged the text, the runner records the stage as degraded, and the answer is not cached.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipeline import attributes as attr
from pipeline.context import RequestContext
from pipeline.guards.injection import InjectionDetector
from pipeline.guards.normalize import scrub_surrogates
from pipeline.guards.policy import PolicyBook
from pipeline.messages import last_user_text
from pipeline.runner import FailurePolicy
from pipeline.stages.guard_in import refuse_injection
from retrieval.vectors import FloatArray

Embed = Callable[[str], Awaitable[FloatArray]]


class GuardSimilarity:
    name = "guard_similarity"
    writes: frozenset[str] = frozenset()
    policy: FailurePolicy = "degrade"

    def __init__(
        self,
        policies: PolicyBook,
        detector: InjectionDetector,
        embed: Embed,
        *,
        beside_retrieval: bool,
    ) -> None:
        self.policies = policies
        self.detector = detector
        self.embed = embed
        self.beside_retrieval = beside_retrieval
        self.reads = frozenset(
            {"principal", "params", *(["query_vector"] if beside_retrieval else [])}
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if self.policies.for_tenant(ctx.caller.tenant).injection != "block":
            return ctx
        text = last_user_text(ctx.params.messages)
        if not text.strip():
            return ctx
        if self.beside_retrieval:
            await ctx.available("query_vector")
        vector = ctx.query_vector
        if vector is None:
            vector = await self.embed(scrub_surrogates(text))
        decision = self.detector.check(text, vector)
        ctx.annotate(
            **{
                attr.GUARD_SIMILARITY: decision.similarity,
                attr.GUARD_INJECTION_SCORE: decision.score,
            }
        )
        if decision.flagged:
            refuse_injection(ctx, decision)
        return ctx
