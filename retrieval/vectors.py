"""Vector search with FAISS: exact inner product for small indexes, HNSW over 8-bit scalar
quantised vectors above a size threshold. Vectors are unit length, so inner product = cosine.

The cascade never uses these indexes: it scores its candidates' stored vectors directly
(`candidate_scores`). They serve dense-only search (benchmarks, and a fallback for callers that
want it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss as _faiss
import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
# The SWIG bindings are only partly described by faiss's stubs.
faiss: Any = _faiss
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 128
# Below this many allowed vectors a filtered dense search is done exactly, because a graph walk
# that may only stop on a small share of its nodes loses recall.
EXACT_BELOW = 20_000


def candidate_scores(vectors: FloatArray, rows: IntArray, query: FloatArray) -> FloatArray:
    """Inner product of the query with the stored vectors of `rows` only."""
    scores: FloatArray = vectors[rows] @ query.astype(np.float32, copy=False)
    return scores


def build_approximate(vectors: FloatArray) -> Any:
    """An HNSW graph over SQ8 codes (a quarter of the float32 memory), for large indexes."""
    index = faiss.index_factory(vectors.shape[1], f"HNSW{HNSW_M},SQ8", faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    data = np.ascontiguousarray(vectors, dtype=np.float32)
    sample = data[np.random.default_rng(0).permutation(len(data))[:100_000]]
    index.train(sample)
    index.add(data)
    return index


def write_index(index: Any, path: Path) -> None:
    """Persist a FAISS index."""
    faiss.write_index(index, str(path))


def read_index(path: Path) -> Any:
    """Load a FAISS index written by `write_index`."""
    return faiss.read_index(str(path))


class DenseIndex:
    """Dense-only top-k over a whole tenant index, optionally restricted by a mask.

    `approximate` is a prebuilt HNSW index; without one an exact IndexFlatIP is built on first
    use (it copies the vectors, so it is only made when dense-only search is actually asked for).
    """

    def __init__(
        self,
        vectors: FloatArray,
        approximate: Any | None = None,
        on_built: Callable[[int], None] | None = None,
    ) -> None:
        self.vectors = vectors
        self.approximate = approximate
        self._flat: Any | None = None
        self._building = threading.Lock()
        self._on_built = on_built  # told the bytes of the exact index once it is built

    def _exact(self) -> Any:
        if self._flat is None:
            with self._building:
                built = self._flat is None
                if built:
                    flat = faiss.IndexFlatIP(self.vectors.shape[1])
                    flat.add(np.ascontiguousarray(self.vectors, dtype=np.float32))
                    self._flat = flat
            if built and self._on_built is not None:
                self._on_built(int(self.vectors.nbytes))
        return self._flat

    def search(
        self, query: FloatArray, k: int, mask: BoolArray | None = None
    ) -> tuple[IntArray, FloatArray]:
        """Rows and scores of the k nearest vectors (among `mask` when given), best first."""
        n = len(self.vectors)
        if n == 0 or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1)
        if mask is not None:
            allowed = np.flatnonzero(mask)
            if len(allowed) < EXACT_BELOW:
                scores = candidate_scores(self.vectors, allowed, q[0])
                top = np.argsort(-scores, kind="stable")[:k]
                return allowed[top].astype(np.int64), scores[top]
        index = self.approximate if self.approximate is not None else self._exact()
        params = None
        if self.approximate is not None:
            params = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, k))
        if mask is not None:
            bitmap = np.packbits(mask, bitorder="little")
            selector = faiss.IDSelectorBitmap(n, faiss.swig_ptr(bitmap))
            if params is None:
                params = faiss.SearchParameters(sel=selector)
            else:
                params.sel = selector
        scores, rows = index.search(q, min(k, n), params=params)
        keep = rows[0] >= 0
        return rows[0][keep].astype(np.int64), scores[0][keep].astype(np.float32)
