"""Retrieval: documents and chunks, BM25, embeddings and FAISS, metadata filters, the
BM25-then-vectors cascade with fusion, and versioned per-tenant index snapshots.

Knows nothing of HTTP or of the request pipeline.
"""

from retrieval.documents import Chunk, Document, DocumentError, chunk_document
from retrieval.embeddings import Embedder, QueryBatcher, make_embedder
from retrieval.filters import Filter, FilterError, parse_filters
from retrieval.hybrid import Hit, HybridRetriever, SearchResult
from retrieval.index import TenantIndex
from retrieval.relevance import GateResult, RelevanceGate, RelevanceModel, gate
from retrieval.store import IndexStore, IngestResult

__all__ = [
    "Chunk",
    "Document",
    "DocumentError",
    "Embedder",
    "Filter",
    "FilterError",
    "GateResult",
    "Hit",
    "HybridRetriever",
    "IndexStore",
    "IngestResult",
    "QueryBatcher",
    "RelevanceGate",
    "RelevanceModel",
    "SearchResult",
    "TenantIndex",
    "chunk_document",
    "gate",
    "make_embedder",
    "parse_filters",
]
