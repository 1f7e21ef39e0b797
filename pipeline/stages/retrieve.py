"""The retrieve stage: the caller's question -> the tenant's best passages, for the prompt.

The tenant comes from the principal, never from the request: each tenant has its own index,
so a search can only touch the caller's documents. The request's ``rag.filters`` narrow it
further (before BM25, and so for the vector side too), and so does a filter derived from the
user's features, on the keys the request's filter leaves open. Then the relevance gate keeps
only the passages whose calibrated relevance (retrieval.relevance) reaches the threshold: an
off-topic question runs without sources rather than with the least irrelevant ones. The query
is the last user message, with the earlier user turns when it depends on them
(pipeline.sources.conversation): "And how does the season change it?" is searched, and judged by
the gate, with the question about vitamin D that came before it.

The explain record counts what each of these kept out: chunks excluded by the request's
filter, chunks the feature filter excluded of the rest, and passages of the top ``top_k``
dropped by the gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from pipeline.context import Passage, RequestContext
from pipeline.model.salt import MemoScope
from pipeline.runner import StageSpec, available
from pipeline.sources.conversation import build_query
from pipeline.sources.filters import parse_request_filters
from pipeline.sources.search import PassageSearch, viewer_of
from pipeline.telemetry import attributes as attr
from retrieval import Filter, RelevanceGate, parse_filters

# Chunks kept out by the request's filter, and by the feature filter of those it allowed.


def feature_defaults(
    requested: Mapping[str, Any] | None, found: Mapping[str, Any]
) -> dict[str, Any]:
    """The feature-derived filter on the keys the request's own filter does not set: on a
    key both set, the request's wins."""
    return {key: value for key, value in found.items() if key not in (requested or {})}


class Retrieve:
    """Searches the caller's index. With ``feature_filters`` (feature name -> metadata key),
    a user's feature becomes a default filter: the query is embedded while the features load,
    then the search waits for them."""

    def __init__(
        self,
        search: PassageSearch,
        *,
        feature_filters: Mapping[str, str] | None = None,
        gate: RelevanceGate | None = None,
        memo_scope: MemoScope,
    ) -> None:
        self.search = search
        # Callers of one memo scope waiting for the same text share one embedding.
        self.memo_scope = memo_scope
        self.feature_filters = dict(feature_filters or {})
        self.gate = gate or RelevanceGate(enabled=False)
        self.spec = StageSpec.of(
            "retrieve",
            reads={"principal", "params", *(["features"] if self.feature_filters else [])},
            writes={"passages", "query_vector"},
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        options = ctx.params.rag
        tenant = ctx.caller.tenant
        # A follow-up that depends on earlier turns is searched with them (the same query
        # feeds the relevance gate); its own vector stays ctx.query_vector for the guards.
        conversation = build_query(ctx.params.messages)
        query = conversation.text
        # A bad filter is a 400, whether or not the search runs.
        requested = parse_request_filters(options.filters, "rag.filters")
        skipped = None
        if not options.enabled:
            skipped = "disabled"
        elif not query.strip():
            skipped = "no user text"
        elif not self.search.has_index(tenant):
            skipped = "no index"
        if skipped is not None:
            ctx.annotate(**{attr.RETRIEVAL_SKIPPED: skipped})
            return ctx
        scope = self.memo_scope(ctx.caller)
        own, *earlier = await asyncio.gather(
            *(self.search.embed(text, scope=scope) for text in (query, *conversation.earlier))
        )
        ctx.query_vector = own
        ctx.annotate(
            **{
                attr.RETRIEVAL_QUERY_MODE: conversation.mode,
                attr.RETRIEVAL_QUERY_REASON: conversation.reason,
                attr.RETRIEVAL_QUERY_TURNS: len(conversation.earlier),
                attr.RETRIEVAL_QUERY_TERM_WEIGHTS: list(conversation.term_weights) or None,
            }
        )
        defaults = await self._feature_filter(ctx, options.filters)
        result = await self.search.search(
            tenant,
            query,
            top_k=options.top_k,
            filters=requested,
            defaults=defaults,
            vector=conversation.blend(own, earlier),
            embed_scope=scope,
            context_terms=conversation.context_terms,
            viewer=viewer_of(ctx.caller),  # only the chunks the caller may see (access lists)
        )
        kept, dropped = self.gate.apply(result.hits, options.min_relevance)
        ctx.passages = [
            Passage(
                document_id=hit.document_id,
                chunk_id=hit.chunk_id,
                title=hit.title,
                text=hit.text,
                score=hit.score,
                relevance=hit.relevance,
            )
            for hit in kept
        ]
        ctx.annotate(
            **{
                attr.RETRIEVAL_ALLOWED: result.allowed,
                attr.RETRIEVAL_EXCLUDED_BY_FILTERS: result.excluded_by_filters,
                attr.RETRIEVAL_EXCLUDED_BY_FEATURES: result.excluded_by_defaults,
                attr.RETRIEVAL_CANDIDATES: result.candidates,
                attr.RETRIEVAL_RESULTS: len(kept),
                attr.RETRIEVAL_DROPPED: len(dropped),
                attr.RETRIEVAL_NO_SOURCES: bool(result.hits) and not kept,
                attr.RETRIEVAL_INDEX_VERSION: result.version,
            }
        )
        return ctx

    async def _feature_filter(
        self, ctx: RequestContext, requested: Mapping[str, Any] | None
    ) -> Filter | None:
        if not self.feature_filters:
            return None
        await available("features")
        found = {
            key: ctx.features.get(name)
            for name, key in self.feature_filters.items()
            if name not in ctx.features.defaulted and ctx.features.get(name) not in (None, "")
        }
        applied = feature_defaults(requested, found)
        if not applied:
            return None
        ctx.annotate(**{attr.RETRIEVAL_FEATURE_FILTER: sorted(applied)})
        # Feature values are checked scalars (pipeline.features.spec), which always parse.
        return parse_filters(applied)
