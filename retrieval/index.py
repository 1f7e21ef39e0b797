"""One tenant's immutable index snapshot in memory: chunk records, vectors, BM25 and metadata
columns, and the function that derives the next snapshot from it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse

from retrieval.bm25 import BM25Index, count_terms, drop_unused_terms, stack_rows
from retrieval.documents import Chunk, Metadata
from retrieval.filters import MetadataColumns
from retrieval.vectors import DenseIndex, FloatArray, build_approximate

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ChunkRecords:
    """The stored fields of an index's chunks, column-wise (row i of each list is chunk i)."""

    chunk_id: list[str]
    document_id: list[str]
    text: list[str]
    title: list[str]
    metadata: list[Metadata]

    def __len__(self) -> int:
        return len(self.chunk_id)

    def take(self, rows: Sequence[int]) -> ChunkRecords:
        """The records of `rows`, in that order."""
        return ChunkRecords(*([column[r] for r in rows] for column in self.columns()))

    def columns(self) -> tuple[list[Any], ...]:
        """The five columns, in field order."""
        return (self.chunk_id, self.document_id, self.text, self.title, self.metadata)

    @staticmethod
    def of(chunks: Sequence[Chunk]) -> ChunkRecords:
        """Records of freshly made chunks."""
        return ChunkRecords(
            [c.chunk_id for c in chunks],
            [c.document_id for c in chunks],
            [c.text for c in chunks],
            [c.title for c in chunks],
            [c.metadata for c in chunks],
        )

    def __add__(self, other: ChunkRecords) -> ChunkRecords:
        return ChunkRecords(*(a + b for a, b in zip(self.columns(), other.columns(), strict=True)))


class TenantIndex:
    """Everything needed to search one tenant at one version; never modified once built.

    `tf` (chunks x terms counts) and `terms` are kept so that the next version can be derived
    without re-tokenising the chunks already indexed.
    """

    def __init__(
        self,
        version: str,
        records: ChunkRecords,
        vectors: FloatArray,
        tf: sparse.csr_array,
        terms: list[str],
        approximate: Any | None = None,
    ) -> None:
        if not len(records) == len(vectors) == tf.shape[0]:
            raise ValueError("records, vectors and term counts disagree on the number of chunks")
        self.version = version
        self.records = records
        self.vectors = vectors
        self.tf = tf
        self.terms = terms
        self.approximate = approximate
        self.bm25 = BM25Index(tf, {t: i for i, t in enumerate(terms)})
        self._columns: MetadataColumns | None = None
        self._dense: DenseIndex | None = None
        self._lazy = threading.Lock()
        rows_by_document: dict[str, list[int]] = {}
        for row, doc_id in enumerate(records.document_id):
            rows_by_document.setdefault(doc_id, []).append(row)
        self.rows_by_document = rows_by_document

    def __len__(self) -> int:
        return len(self.records)

    @property
    def columns(self) -> MetadataColumns:
        """Metadata columns for filtering, built on first use."""
        if self._columns is None:
            with self._lazy:
                if self._columns is None:
                    self._columns = MetadataColumns(self.records.metadata)
        return self._columns

    @property
    def dense(self) -> DenseIndex:
        """Dense-only search over all chunks (FAISS), built on first use."""
        if self._dense is None:
            with self._lazy:
                if self._dense is None:
                    self._dense = DenseIndex(self.vectors, self.approximate)
        return self._dense

    @property
    def documents(self) -> int:
        """Number of distinct documents."""
        return len(self.rows_by_document)

    @property
    def nbytes(self) -> int:
        """Bytes held in arrays (vectors, postings, term counts); Python objects not counted."""
        tf_bytes = self.tf.data.nbytes + self.tf.indices.nbytes + self.tf.indptr.nbytes
        return int(self.vectors.nbytes + self.bm25.nbytes + tf_bytes)


def derive(
    old: TenantIndex | None,
    version: str,
    *,
    remove: set[str],
    chunks: Sequence[Chunk],
    tokens: Sequence[Sequence[str]],
    vectors: FloatArray,
    approximate_above: int,
) -> TenantIndex:
    """The next snapshot: `old` without the documents in `remove`, plus the new chunks."""
    dimension = vectors.shape[1]
    if old is None:
        kept = ChunkRecords([], [], [], [], [])
        kept_vectors = np.zeros((0, dimension), dtype=np.float32)
        vocab: dict[str, int] = {}
        parts: list[sparse.csr_array] = []
    else:
        rows = [r for doc, rs in old.rows_by_document.items() if doc not in remove for r in rs]
        rows.sort()
        kept = old.records.take(rows)
        kept_vectors = np.asarray(old.vectors[rows], dtype=np.float32)
        vocab = {t: i for i, t in enumerate(old.terms)}
        parts = [old.tf[rows]] if rows else []
    new_tf = count_terms(tokens, vocab)
    tf = stack_rows([*parts, new_tf], len(vocab))
    terms = list(vocab)
    tf, terms = drop_unused_terms(tf, terms)
    all_vectors = np.ascontiguousarray(np.vstack([kept_vectors, vectors]), dtype=np.float32)
    approximate = build_approximate(all_vectors) if len(all_vectors) > approximate_above else None
    return TenantIndex(version, kept + ChunkRecords.of(chunks), all_vectors, tf, terms, approximate)
