"""Retrieval as the request path uses it: async, traced, tenant-scoped.

Chat's retrieve stage and the ``/v1/retrieve`` and ``/v1/documents`` routes all go through
this one class, so they share the filter parsing, the query batching and the spans.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from pipeline.errors import InvalidRequest, ServiceUnavailable
from pipeline.telemetry import attributes as attr
from retrieval import (
    Document,
    Filter,
    FilterError,
    HybridRetriever,
    IndexStore,
    IngestResult,
    QueryBatcher,
    SearchResult,
    parse_filters,
)
from retrieval.tokenize import tokenize
from retrieval.vectors import FloatArray


def parse_request_filters(spec: Any, param: str = "rag.filters") -> Filter | None:
    """The request's filter, or a 400 naming what is wrong with it and the request's field
    that holds it (``rag.filters`` on chat, ``filters`` on /v1/retrieve)."""
    if spec is None:
        return None
    try:
        return parse_filters(spec)
    except FilterError as exc:
        raise InvalidRequest(f"Invalid {param}: {exc}", param=param) from exc


class PassageSearch:
    def __init__(
        self,
        store: IndexStore,
        retriever: HybridRetriever,
        queries: QueryBatcher,
        tracer: trace.Tracer,
    ) -> None:
        self.store = store
        self.retriever = retriever
        self.queries = queries
        self.tracer = tracer

    def version(self, tenant: str) -> str:
        return self.store.version(tenant)

    def idf(self, tenant: str, query: str) -> dict[str, float]:
        """The tenant index's IDF of the query's terms (what compression weighs words by)."""
        index = self.store.current(tenant)
        return {} if index is None else index.bm25.idf_of(tokenize(query))

    def has_index(self, tenant: str) -> bool:
        return self.store.current(tenant) is not None

    async def embed(self, query: str) -> FloatArray:
        """The query's vector (batched with other requests' queries, off the event loop).

        A failure of the embedding model is converted here: a 503 for the request, never an
        unhandled error."""
        try:
            return await self.queries.embed(query)
        except Exception as exc:
            raise ServiceUnavailable(
                f"The embedding model failed ({type(exc).__name__}).", code="embedding_unavailable"
            ) from exc

    async def search(
        self,
        tenant: str,
        query: str,
        *,
        top_k: int,
        filters: Filter | None = None,
        defaults: Filter | None = None,
        vector: FloatArray | None = None,
    ) -> SearchResult:
        """The tenant's best passages for ``query``, within the request's ``filters`` and the
        ``defaults`` it did not write (each parsed by ``parse_request_filters``, which names the
        caller's field). ``vector`` is the query's, when the caller has embedded it already."""
        with self.tracer.start_as_current_span(
            f"retrieval {tenant}", attributes={attr.TENANT: tenant}
        ) as span:
            started = time.perf_counter()
            if vector is None:
                vector = await self.embed(query)
            embed_ms = (time.perf_counter() - started) * 1000.0
            result = await asyncio.to_thread(
                self.retriever.search,
                tenant,
                query,
                vector,
                top_k=top_k,
                filters=filters,
                defaults=defaults,
            )
            timings = {"embed": embed_ms, **result.timings_ms}
            span.set_attributes(
                {
                    attr.RETRIEVAL_ALLOWED: result.allowed,
                    attr.RETRIEVAL_CANDIDATES: result.candidates,
                    attr.RETRIEVAL_RESULTS: len(result.hits),
                    attr.RETRIEVAL_INDEX_VERSION: result.version,
                    **{
                        f"{attr.RETRIEVAL_TIMING_PREFIX}{step}": round(ms, 3)
                        for step, ms in timings.items()
                    },
                }
            )
        return result

    async def ingest(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        with self.tracer.start_as_current_span(
            f"ingest {tenant}",
            attributes={attr.TENANT: tenant, attr.INGEST_DOCUMENTS: len(documents)},
        ):
            return await asyncio.to_thread(self.store.upsert, tenant, list(documents))

    async def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        with self.tracer.start_as_current_span(
            f"delete {tenant}", attributes={attr.TENANT: tenant}
        ):
            return await asyncio.to_thread(self.store.delete, tenant, list(document_ids))

    async def aclose(self) -> None:
        await self.queries.aclose()
