"""Retrieval backends: where a tenant's chunks live and how they are searched, behind one
narrow interface, so the request path, the routes, `rag ingest` and the cache keys never ask
which one a tenant uses.

- `EmbeddedBackend` (retrieval.backends.embedded): today's per-tenant snapshots (IndexStore)
  searched in-process by the BM25-then-vectors cascade (HybridRetriever). The default.
- `MilvusBackend` (retrieval.backends.milvus): one Milvus collection per deployment; BM25 inside
  Milvus with the filter applied by the server, then the candidates' stored vectors and the same
  fusion (retrieval.fusion). For tenants that outgrow a replica's memory.
- `BackendRouter` (retrieval.backends.router): which backend serves a tenant.

Every method is blocking (disk, CPU, network): callers on an event loop run them in a thread
pool (pipeline.sources.search.PassageSearch does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: importing a backend module need not load the index code
    from retrieval.access import Viewer
    from retrieval.documents import Chunk, Document
    from retrieval.filters import Filter
    from retrieval.hybrid import SearchResult
    from retrieval.store import IngestResult
    from retrieval.vectors import FloatArray


class BackendUnavailable(RuntimeError):
    """A backend's store (a Milvus server, the Redis that keeps index versions) did not answer
    or refused a call: the request path answers 503, not 500 (pipeline.sources.search)."""


@dataclass(frozen=True)
class BackendStats:
    """What a tenant's index holds."""

    backend: str
    version: str
    documents: int
    chunks: int


@dataclass(frozen=True)
class ChunkBatch:
    """Chunks with their vectors (row i of `vectors` is chunk i's): what a move copies, so the
    target indexes exactly the source's passages without re-chunking or re-embedding them."""

    chunks: list[Chunk]
    vectors: FloatArray


class RetrievalBackend(Protocol):
    """A tenant-scoped chunk index with the BM25-then-vectors search."""

    name: str

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
        """The tenant's best `top_k` chunks that `viewer` may see and both filters allow."""
        ...

    def upsert(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        """Add documents, replacing (all chunks of) any with the same id."""
        ...

    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        """Remove documents, every chunk of each."""
        ...

    def version(self, tenant: str) -> str:
        """The tenant's index version (cache keys): changes with every write. Cheap."""
        ...

    def stats(self, tenant: str) -> BackendStats:
        """Documents and chunks the tenant has."""
        ...

    def has_index(self, tenant: str) -> bool:
        """Whether the tenant has ever been written to (cheap; the retrieve stage asks)."""
        ...

    def document_ids(self, tenant: str) -> set[str]:
        """The ids of the tenant's documents."""
        ...

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        """IDF of the query's terms as `viewer` sees the index (compression weighs by it)."""
        ...

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        """The index version and what of `viewer` decides what it sees (for cache keys)."""
        ...

    def export(self, tenant: str, batch: int = 500) -> Iterator[ChunkBatch]:
        """All the tenant's chunks with their vectors, in batches (for a move)."""
        ...

    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        """Index already made chunks and vectors, replacing their documents' chunks."""
        ...

    def close(self) -> None:
        """Release connections (and, for Milvus Lite, its embedded server)."""
        ...


__all__ = ["BackendStats", "ChunkBatch", "RetrievalBackend"]
