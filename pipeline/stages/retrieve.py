"""The retrieve stage: the caller's question -> the tenant's best passages, for the prompt.

The tenant comes from the principal, never from the request: each tenant has its own index,
so a search can only touch the caller's documents. The request's ``rag.filters`` narrow it
further (before BM25, and so for the vector side too).
"""

from __future__ import annotations

from typing import Any

from pipeline import attributes as attr
from pipeline.context import Passage, RequestContext
from pipeline.search import PassageSearch, parse_request_filters


def query_text(messages: list[dict[str, Any]]) -> str:
    """What to search for: the last user message's text."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    str(part.get("text", "")) for part in content if isinstance(part, dict)
                )
    return ""


class Retrieve:
    name = "retrieve"

    def __init__(self, search: PassageSearch) -> None:
        self.search = search

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        assert ctx.principal is not None, "auth runs before retrieval"
        options = ctx.params.rag
        tenant = ctx.principal.tenant
        query = query_text(ctx.params.messages)
        skipped = None
        if not options.enabled:
            skipped = "disabled"
        elif not query.strip():
            skipped = "no user text"
        elif not self.search.has_index(tenant):
            skipped = "no index"
        if skipped is not None:
            parse_request_filters(options.filters)  # a bad filter is a 400 all the same
            ctx.annotate(**{attr.RETRIEVAL_SKIPPED: skipped})
            return ctx
        result = await self.search.search(
            tenant, query, top_k=options.top_k, filters=options.filters
        )
        ctx.passages = [
            Passage(
                document_id=hit.document_id,
                chunk_id=hit.chunk_id,
                title=hit.title,
                text=hit.text,
                score=hit.score,
            )
            for hit in result.hits
        ]
        ctx.annotate(
            **{
                attr.RETRIEVAL_CANDIDATES: result.candidates,
                attr.RETRIEVAL_RESULTS: len(result.hits),
                attr.RETRIEVAL_INDEX_VERSION: result.version,
            }
        )
        return ctx
