"""Retrieval: documents and chunks, BM25, embeddings and FAISS, metadata filters, the
BM25-then-vectors cascade with fusion, and versioned per-tenant index snapshots.

Knows nothing of HTTP or of the request pipeline.

The names below are loaded when first used (PEP 562), not when the package is: importing a
light module such as ``retrieval.tenants`` or ``retrieval.access`` (the settings and the key
store do) would otherwise pull in FAISS, scipy and the index code, and every ``rag`` command
would pay for that before it does anything.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # "as": the names are this package's own, for the type checker
    from retrieval.documents import Chunk as Chunk
    from retrieval.documents import Document as Document
    from retrieval.documents import DocumentError as DocumentError
    from retrieval.documents import chunk_document as chunk_document
    from retrieval.embeddings import Embedder as Embedder
    from retrieval.embeddings import QueryBatcher as QueryBatcher
    from retrieval.embeddings import make_embedder as make_embedder
    from retrieval.filters import Filter as Filter
    from retrieval.filters import FilterError as FilterError
    from retrieval.filters import parse_filters as parse_filters
    from retrieval.hybrid import Hit as Hit
    from retrieval.hybrid import HybridRetriever as HybridRetriever
    from retrieval.hybrid import SearchResult as SearchResult
    from retrieval.index import TenantIndex as TenantIndex
    from retrieval.relevance import GateResult as GateResult
    from retrieval.relevance import RelevanceGate as RelevanceGate
    from retrieval.relevance import RelevanceModel as RelevanceModel
    from retrieval.relevance import gate as gate
    from retrieval.store import IndexStore as IndexStore
    from retrieval.store import IngestResult as IngestResult

_HOME = {
    "documents": ("Chunk", "Document", "DocumentError", "chunk_document"),
    "embeddings": ("Embedder", "QueryBatcher", "make_embedder"),
    "filters": ("Filter", "FilterError", "parse_filters"),
    "hybrid": ("Hit", "HybridRetriever", "SearchResult"),
    "index": ("TenantIndex",),
    "relevance": ("GateResult", "RelevanceGate", "RelevanceModel", "gate"),
    "store": ("IndexStore", "IngestResult"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'retrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"retrieval.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
