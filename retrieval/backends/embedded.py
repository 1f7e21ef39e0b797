"""The embedded backend: per-tenant snapshots on disk (IndexStore), searched in-process by
HybridRetriever. A thin adapter: it changes nothing of how either behaves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from retrieval.access import Viewer, whole_viewer
from retrieval.backends import BackendStats, ChunkBatch
from retrieval.documents import Chunk, Document
from retrieval.filters import Filter
from retrieval.hybrid import HybridRetriever, SearchResult
from retrieval.store import IndexStore, IngestResult
from retrieval.tokenize import tokenize
from retrieval.vectors import FloatArray
from retrieval.versions import NO_VERSION


class EmbeddedBackend:
    """`store`'s snapshots searched by `retriever` (which must search that same store)."""

    name = "embedded"

    def __init__(self, store: IndexStore, retriever: HybridRetriever) -> None:
        if retriever.store is not store:
            raise ValueError("the retriever must search the backend's own store")
        self.store = store
        self.retriever = retriever

    def search(
        self,
        tenant: str,
        query: str,
        query_vector: FloatArray | None,
        *,
        top_k: int = 5,
        filters: Filter | None = None,
        defaults: Filter | None = None,
        viewer: Viewer | None = None,
        context_terms: Sequence[tuple[str, float]] = (),
    ) -> SearchResult:
        return self.retriever.search(
            tenant,
            query,
            query_vector,
            top_k=top_k,
            filters=filters,
            defaults=defaults,
            viewer=viewer,
            context_terms=context_terms,
        )

    def upsert(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        return self.store.upsert(tenant, documents)

    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        return self.store.delete(tenant, document_ids)

    def version(self, tenant: str) -> str:
        return self.store.version(tenant)

    def stats(self, tenant: str) -> BackendStats:
        index = self.store.current(tenant)
        if index is None:
            return BackendStats(self.name, NO_VERSION, 0, 0)
        return BackendStats(self.name, index.version, index.documents, len(index))

    def has_index(self, tenant: str) -> bool:
        return self.store.version(tenant) != NO_VERSION  # the pointer alone: nothing loaded

    def document_ids(self, tenant: str) -> set[str]:
        index = self.store.current(tenant)
        return set(index.rows_by_document) if index is not None else set()

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        """Hidden chunks weigh nothing: the view is the one the same request's search built.
        Read on the event loop, so from the snapshot loaded (``IndexStore.peek``): with none,
        empty (compression then weighs words over the passages it compresses, as for Milvus)."""
        index = self.store.peek(tenant)
        if index is None:
            return {}
        return index.visible_to(viewer).bm25.idf_of(tokenize(query))

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        """Version and scope read from one snapshot (`AccessColumns.scope`). Read on the event
        loop, so from the snapshot loaded (``IndexStore.peek``): while the published one is
        not (loading elsewhere, let go, or never loaded here), the published version and the
        whole viewer, finer than any access scope (safe to key by; one request's answer then
        keyed apart), rather than a load here."""
        index = self.store.peek(tenant)
        if index is None:
            version = self.store.version(tenant)
            if version == NO_VERSION:
                return version, None
            return version, whole_viewer(viewer)
        return index.version, index.access.scope(viewer)

    def export(self, tenant: str, batch: int = 500) -> Iterator[ChunkBatch]:
        """Whole documents per batch (a batch replaces its documents' chunks on import)."""
        index = self.store.current(tenant)
        if index is None:
            return
        records = index.records
        rows: list[int] = []
        for document_rows in index.rows_by_document.values():
            rows.extend(document_rows)
            if len(rows) >= batch:
                yield _batch(records, index.vectors, rows)
                rows = []
        if rows:
            yield _batch(records, index.vectors, rows)

    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        return self.store.import_chunks(tenant, batch.chunks, batch.vectors)

    def close(self) -> None:
        """Nothing to release: snapshots are files."""


def _batch(records: Any, vectors: FloatArray, rows: list[int]) -> ChunkBatch:
    chunks = [
        Chunk(
            chunk_id=records.chunk_id[r],
            document_id=records.document_id[r],
            text=records.text[r],
            title=records.title[r],
            metadata=dict(records.metadata[r]),
            access=records.access[r],
        )
        for r in rows
    ]
    return ChunkBatch(chunks, np.ascontiguousarray(vectors[rows], dtype=np.float32))
