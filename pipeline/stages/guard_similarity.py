"""The second input guardrail: how close the question's embedding is to known injection attacks.

It runs in the concurrent group beside retrieval, and uses the query vector retrieval computes
anyway (embedding it itself only when retrieval did not), so it costs no embedding of its own on
the usual path and nothing at all on a cache hit: a cached answer's key holds the exact text
and the guard policy, so that text passed this check before. A flagged request fails the group
(the stage is fatal), which cancels its siblings, before any answer is generated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipeline import attributes as attr
from pipeline.context import RequestContext, current_record
from pipeline.errors import ServiceUnavailable
from pipeline.guards.injection import InjectionDetector
from pipeline.guards.normalize import scrub_surrogates
from pipeline.guards.policy import PolicyBook
from pipeline.messages import last_user_text
from pipeline.runner import FailurePolicy
from pipeline.stages.guard_in import Blocked
from retrieval.vectors import FloatArray

Embed = Callable[[str], Awaitable[FloatArray]]


class GuardSimilarity:
    name = "guard_similarity"
    writes: frozenset[str] = frozenset()
    policy: FailurePolicy = "fatal"

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
            try:
                vector = await self.embed(scrub_surrogates(text))
            except ServiceUnavailable as exc:
                # The rules (guard_in) have judged the text; without a model this signal is
                # skipped, and the stage says it ran degraded (so its answer is not cached).
                record = current_record()
                if record is not None:
                    record.status = "degraded"
                ctx.annotate(**{attr.GUARD_SIMILARITY_SKIPPED: exc.message})
                return ctx
        decision = self.detector.check(text, vector)
        ctx.annotate(
            **{
                attr.GUARD_SIMILARITY: decision.similarity,
                attr.GUARD_INJECTION_SCORE: decision.score,
            }
        )
        if decision.flagged:
            ctx.annotate(**{attr.GUARD_INJECTION_RULE: decision.rule})
            raise Blocked(
                "The request looks like an attempt to override the assistant's instructions "
                f"({decision.rule}).",
                decision.rule or "injection",
            )
        return ctx
