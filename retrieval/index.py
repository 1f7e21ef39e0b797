"""One tenant's immutable index snapshot in memory: chunk records, vectors, BM25 and metadata
columns, and the function that derives the next snapshot from it."""

from __future__ import annotations

import hashlib
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse

from retrieval.access import AccessColumns, AccessList, Viewer
from retrieval.bm25 import BM25Index, count_terms, drop_unused_terms, stack_rows
from retrieval.documents import Chunk, Metadata
from retrieval.filters import MetadataColumns
from retrieval.resident import (
    access_bytes,
    faiss_bytes,
    metadata_bytes,
    range_ints_bytes,
    short_strings_bytes,
    strings_bytes,
)
from retrieval.vectors import DenseIndex, FloatArray, build_approximate

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# Views (`TenantIndex.visible_to`) kept per snapshot: one per distinct set of visible chunks,
# at most `MAX_VIEWS` of them and what they hold (`resident_bytes`) at most `VIEW_BUDGET` times
# the snapshot's own arrays in all. A view copies its visible vectors, term counts and BM25
# weights, points to its snapshot's texts and metadata, and a dense-only search adds a FAISS
# copy of its vectors: a viewer seeing 55% of SciFact holds 62% of the snapshot's arrays, so
# twice them keeps three such views. The least recently used go first; the newest view is
# always kept, so a viewer's next search reuses it.
MAX_VIEWS = 8
VIEW_BUDGET = 2.0


@dataclass(frozen=True)
class ChunkRecords:
    """The stored fields of an index's chunks, column-wise (row i of each list is chunk i).

    `access` may be left empty (records made before access lists): every chunk is then
    visible to the whole tenant."""

    chunk_id: list[str]
    document_id: list[str]
    text: list[str]
    title: list[str]
    metadata: list[Metadata]
    access: list[AccessList | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.access and self.chunk_id:
            self.access.extend([None] * len(self.chunk_id))

    def __len__(self) -> int:
        return len(self.chunk_id)

    def take(self, rows: Sequence[int]) -> ChunkRecords:
        """The records of `rows`, in that order."""
        return ChunkRecords(*([column[r] for r in rows] for column in self.columns()))

    def columns(self) -> tuple[list[Any], ...]:
        """The six columns, in field order."""
        return (self.chunk_id, self.document_id, self.text, self.title, self.metadata, self.access)

    @staticmethod
    def of(chunks: Sequence[Chunk]) -> ChunkRecords:
        """Records of freshly made chunks."""
        return ChunkRecords(
            [c.chunk_id for c in chunks],
            [c.document_id for c in chunks],
            [c.text for c in chunks],
            [c.title for c in chunks],
            [c.metadata for c in chunks],
            [c.access for c in chunks],
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
        *,
        records_of: TenantIndex | None = None,
    ) -> None:
        if not len(records) == len(records.access) == len(vectors) == tf.shape[0]:
            raise ValueError("records, vectors and term counts disagree on the number of chunks")
        self.version = version
        self.records = records
        self.vectors = vectors
        self.tf = tf
        self.terms = terms
        self.approximate = approximate
        self.bm25 = BM25Index(tf, {t: i for i, t in enumerate(terms)})
        self._columns: MetadataColumns | None = None
        self._access: AccessColumns | None = None
        self._views: OrderedDict[bytes, TenantIndex] = OrderedDict()
        self._dense: DenseIndex | None = None
        self._lazy = threading.Lock()
        # Held while a view is looked up or built: concurrent searches of one visible set (the
        # search pool's threads) wait for the one build instead of building duplicates.
        self._view_lock = threading.Lock()
        rows_by_document: dict[str, list[int]] = {}
        for row, doc_id in enumerate(records.document_id):
            rows_by_document.setdefault(doc_id, []).append(row)
        self.rows_by_document = rows_by_document
        # A view's snapshot, held weakly: a view must not keep a let-go snapshot alive.
        self._records_of = None if records_of is None else weakref.ref(records_of)
        # `resident_bytes`' parts: what it is built with (counted once, on first use), what
        # searches built since, and the kept views' (as last counted).
        self._base_bytes: int | None = None
        self._built_bytes = 0
        self._views_bytes = 0
        # Told when a search built something on this snapshot (the loaded-snapshot budget).
        self.on_grew: Callable[[TenantIndex], None] | None = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def columns(self) -> MetadataColumns:
        """Metadata columns for filtering, built on first use."""
        if self._columns is None:
            with self._lazy:
                if self._columns is None:
                    columns = MetadataColumns(self.records.metadata)
                    self._built_bytes += columns.nbytes()
                    self._columns = columns
            self._grew()
        return self._columns

    @property
    def access(self) -> AccessColumns:
        """Access-list columns (retrieval.access), built on first use."""
        if self._access is None:
            with self._lazy:
                if self._access is None:
                    access = AccessColumns(self.records.access)
                    self._built_bytes += access.nbytes()
                    self._access = access
            self._grew()
        return self._access

    def visible_to(self, viewer: Viewer | None) -> TenantIndex:
        """This snapshot as `viewer` may see it: itself when the viewer sees every chunk, else a
        snapshot of only the visible chunks, with BM25 statistics (IDF, average length) of
        those chunks alone, so that no score, rank or count of a search depends on a chunk the
        viewer may not see (otherwise the IDF of a word would tell how many hidden chunks hold
        it). Views are built once per distinct visible set (one build at a time per snapshot) and
        kept, least recently used first out, within `MAX_VIEWS` and `VIEW_BUDGET`."""
        mask = self.access.mask(viewer)
        if mask is None or bool(mask.all()):
            return self
        return self._view(mask)

    def _view(self, mask: BoolArray) -> TenantIndex:
        key = hashlib.blake2b(np.packbits(mask).tobytes(), digest_size=16).digest()
        before = self._views_bytes
        try:
            return self._kept_view(key, mask)
        finally:
            if self._views_bytes != before:
                self._grew()

    def _kept_view(self, key: bytes, mask: BoolArray) -> TenantIndex:
        with self._view_lock:
            view = self._views.get(key)
            if view is None:
                rows = np.flatnonzero(mask)
                tf, terms = drop_unused_terms(sparse.csr_array(self.tf[rows]), list(self.terms))
                vectors = np.ascontiguousarray(self.vectors[rows], dtype=np.float32)
                records = self.records.take(rows.tolist())
                view = TenantIndex(self.version, records, vectors, tf, terms, records_of=self)
                self._views[key] = view
            self._views.move_to_end(key)
            self._evict_views()
            return view

    def _evict_views(self) -> None:
        """Drop the least recently used views past `MAX_VIEWS` or `VIEW_BUDGET`, never the
        newest. Checked on every `visible_to`, so a view that grew since (a dense-only
        search built its FAISS copy) is counted at the next one."""
        budget = VIEW_BUDGET * self.own_nbytes
        while len(self._views) > 1 and (
            len(self._views) > MAX_VIEWS or self._count_views() > budget
        ):
            self._views.popitem(last=False)
        self._views_bytes = self._count_views()

    def _count_views(self) -> int:
        return sum(view.resident_bytes for view in self._views.values())

    def _grew(self) -> None:
        """A search built something on this snapshot, or its views changed: a view's snapshot
        counts it among its views now (its next `visible_to` lets views go for it), and the
        snapshot's `on_grew` is told."""
        if self._records_of is not None:
            parent = self._records_of()
            if parent is None:
                return
            with parent._view_lock:
                parent._views_bytes = parent._count_views()
            parent._grew()
        elif self.on_grew is not None:
            self.on_grew(self)

    @property
    def dense(self) -> DenseIndex:
        """Dense-only search over all chunks (FAISS), built on first use."""
        if self._dense is None:
            with self._lazy:
                if self._dense is None:
                    self._dense = DenseIndex(self.vectors, self.approximate, self._dense_built)
        return self._dense

    def _dense_built(self, nbytes: int) -> None:
        """The exact dense search's FAISS copy of the vectors is built (on its first use)."""
        with self._lazy:
            self._built_bytes += nbytes
        self._grew()

    @property
    def documents(self) -> int:
        """Number of distinct documents."""
        return len(self.rows_by_document)

    @property
    def own_nbytes(self) -> int:
        """Bytes held in this snapshot's own arrays (vectors, postings, term counts)."""
        tf_bytes = self.tf.data.nbytes + self.tf.indices.nbytes + self.tf.indptr.nbytes
        return int(self.vectors.nbytes + self.bm25.nbytes + tf_bytes)

    @property
    def resident_bytes(self) -> int:
        """What this snapshot holds in memory now (retrieval.resident): its arrays, records,
        terms and HNSW graph; the filter and access columns and the exact FAISS copy searches
        built since; and the kept views' (`VIEW_BUDGET`). A view counts
        its records' lists, not the strings and metadata it shares with its snapshot. Cheap
        after the first call, and read without a lock."""
        return self._own_bytes() + self._views_bytes

    def _own_bytes(self) -> int:
        if self._base_bytes is None:
            self._base_bytes = self._count_base()  # two threads may both count: the same
        return self._base_bytes + self._built_bytes

    def _count_base(self) -> int:
        """The bytes of what this snapshot is built with (counted once: it never changes)."""
        records = self.records
        rows = len(records)
        total = self.own_nbytes + sum(map(sys.getsizeof, records.columns()))
        # The terms, their columns' numbers, and each document's row numbers.
        total += sys.getsizeof(self.terms) + sys.getsizeof(self.bm25.vocab)
        total += range_ints_bytes(len(self.terms)) + range_ints_bytes(rows)
        total += sys.getsizeof(self.rows_by_document)
        total += sum(map(sys.getsizeof, self.rows_by_document.values()))
        if self.approximate is not None:
            total += faiss_bytes(self.approximate)
        if self._records_of is not None:
            return total  # the strings, metadata and access lists are the snapshot's
        total += strings_bytes(records.text) + strings_bytes(records.title)
        total += short_strings_bytes(records.chunk_id) + short_strings_bytes(records.document_id)
        total += short_strings_bytes(self.terms)
        return total + metadata_bytes(records.metadata) + access_bytes(records.access)


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
        kept = ChunkRecords([], [], [], [], [], [])
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
