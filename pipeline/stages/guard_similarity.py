"""The second input guardrail: how close the question's embedding is to known injection attacks.

It runs in the concurrent group beside retrieval, and uses the query vector retrieval computes
anyway (embedding it itself only when retrieval did not), so it costs no embedding of its own on
the usual path and nothing at all on a cache hit: a cached answer's key holds the exact text
and the guard policy, so that text passed this check before. The rules have judged the text
already (`guard_in`); this stage adds the similarity signal: a strong one decides alone, a weak
one together with the rules' weak signals (read again only then). A flagged request fails the
group (a refusal ends the request under any policy), which cancels its siblings, before any
answer is generated.

The verdict depends on the text alone, never on load:

- Query vectors are embedded in batches with other requests' queries, and padding to the
  batch's longest text moves a vector by float noise (about 1e-7 per component, measured with
  MiniLM). A verdict is taken from the batched vector only when its cosines are more than
  `BATCH_NOISE` (1e-3, hundreds of times that noise) from changing it; closer than that, the
  text is embedded again alone, in a batch of one, and that vector decides. So the verdict is
  always the one the text's own vector gives, idle or under load.
- If the check cannot run (the embedding model fails), the request is refused with a 503 that
  a client retries: the stage is ``fatal``, not ``degrade``. Answering with the rules alone
  would make the verdict depend on the embedder's health, which load and faults move, and give
  a caller a reason to push the service into that state; retrieval needs the same model, so
  while it is down most requests fail with a 503 anyway. There is no time budget of its own:
  under load the check waits for its embedding like retrieval does, within the request's
  deadline, and a request past its deadline gets a 504, never an unchecked answer.
"""

from __future__ import annotations

import asyncio

from pipeline.context import RequestContext
from pipeline.errors import ServiceUnavailable
from pipeline.guards.injection import Closeness, InjectionDetector, decide, rule_signals
from pipeline.guards.normalize import scrub_surrogates
from pipeline.guards.policy import PolicyBook
from pipeline.model.messages import last_user_text
from pipeline.model.salt import MemoScope
from pipeline.runner import StageSpec, available
from pipeline.stages.guard_in import refuse_injection
from pipeline.telemetry import attributes as attr
from retrieval.embeddings import EmbedQuery
from retrieval.vectors import FloatArray

BATCH_NOISE = 1e-3  # cosine; batching moves it by ~1e-6 at most


class GuardSimilarity:
    def __init__(
        self,
        policies: PolicyBook,
        detector: InjectionDetector,
        embed: EmbedQuery,
        *,
        beside_retrieval: bool,
        memo_scope: MemoScope,
    ) -> None:
        self.policies = policies
        # Callers of one memo scope waiting for the same text share one embedding.
        self.memo_scope = memo_scope
        self.detector = detector
        self.embed = embed
        self.beside_retrieval = beside_retrieval
        self.spec = StageSpec.of(
            "guard_similarity",
            reads={"principal", "params", *(["query_vector"] if beside_retrieval else [])},
            optional={"query_vector"},
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if self.policies.for_tenant(ctx.caller.tenant).injection != "block":
            return ctx
        text = scrub_surrogates(last_user_text(ctx.params.messages))
        if not text.strip():
            return ctx
        if self.beside_retrieval:
            await available("query_vector")
        vector = ctx.query_vector
        if vector is None:
            vector = await self.embed(text, scope=self.memo_scope(ctx.caller))
        near = await self.closeness(text, vector)
        if near is None:
            return ctx
        signals = [near.signal] if near.signal is not None else []
        if signals and near.score < self.detector.threshold:
            # A weak similarity counts with the rules' weak signals (guard_in had them alone).
            signals += await asyncio.to_thread(rule_signals, text)
        decision = decide(signals, self.detector.threshold, near.injection)
        ctx.annotate(
            **{
                attr.GUARD_SIMILARITY: near.injection,
                attr.GUARD_INJECTION_SCORE: decision.score,
            }
        )
        if decision.flagged:
            refuse_injection(ctx, decision)
        return ctx

    async def closeness(self, text: str, vector: FloatArray) -> Closeness | None:
        """The similarity verdict of `text`, from `vector` (its embedding, maybe batched) when
        float noise cannot flip it, else from the text embedded alone."""
        near = self.detector.closeness(vector)
        if near is None or near.slack > BATCH_NOISE:
            return near
        try:
            alone = await asyncio.to_thread(self.detector.embed_alone, text)
        except Exception as exc:
            raise ServiceUnavailable(
                f"The embedding model failed ({type(exc).__name__}).", code="embedding_unavailable"
            ) from exc
        return near if alone is None else self.detector.closeness(alone)
