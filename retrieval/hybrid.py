"""The retrieval cascade: metadata filter -> BM25 candidates -> vector scores of those candidates
only -> fusion. Also BM25-only and dense-only rankings, for the benchmarks and for comparison.

The candidate count and fusion defaults were chosen on SciFact's train split with
`python -m bench.retrieval_tune` (see bench/results/retrieval.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from retrieval.access import Viewer
from retrieval.documents import Metadata
from retrieval.filters import Filter
from retrieval.fusion import FusionMethod, fuse
from retrieval.index import TenantIndex
from retrieval.relevance import DEFAULT_MODEL, RelevanceModel, normalised_bm25
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize
from retrieval.vectors import FloatArray, candidate_scores
from retrieval.versions import NO_VERSION

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# Tuned on SciFact train (bench/retrieval_tune.py): min-max fusion beat every RRF setting
# (0.735 vs 0.730 nDCG@10), and N from 50 to 1000 is a plateau within 0.002, so the fewest
# candidates on it are taken.
DEFAULT_CANDIDATES = 100
DEFAULT_FUSION: FusionMethod = "minmax"
DEFAULT_VECTOR_WEIGHT = 0.65
DEFAULT_RRF_K = 60.0


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk; `score` is the fused score (or the single ranking's score).

    `bm25_norm` (BM25 over the query's attainable maximum, 0 when no query term matched) and
    `vector_score` (cosine) are comparable across queries; `relevance` is the relevance model's
    score over both (retrieval.relevance). Both are None where the search did not compute them
    (`relevance` needs the two signals: None for BM25-only and dense-only searches).
    """

    chunk_id: str
    document_id: str
    score: float
    text: str
    title: str
    metadata: Metadata
    bm25_score: float | None
    vector_score: float | None
    bm25_norm: float | None = None
    relevance: float | None = None


@dataclass(frozen=True)
class SearchResult:
    """Hits best first; `candidates` scored by vectors, `allowed` chunks passing the filters;
    `timings_ms` has the keys filter, bm25, vector, fusion; `version` of the index searched.

    The chunks the filters kept out, by filter: `excluded_by_filters` those `filters` excludes,
    `excluded_by_defaults` those `defaults` excludes of the rest (so the index holds
    `allowed + excluded_by_filters + excluded_by_defaults` chunks, plus those the viewer may
    not see, which no count includes: a search says nothing of chunks hidden from its viewer).
    """

    hits: list[Hit]
    candidates: int
    allowed: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    version: str = NO_VERSION
    excluded_by_filters: int = 0
    excluded_by_defaults: int = 0


def query_terms(
    query: str, context_terms: Sequence[tuple[str, float]] = ()
) -> tuple[list[str], list[float] | None]:
    """The BM25 tokens of `query` and of each `(text, weight)` of `context_terms`, with their
    weights (the query's at 1); None for weights when there is no context, which scores
    exactly as before. A word in both counts twice: once at 1, once at its context weight."""
    tokens = tokenize(query)
    if not context_terms:
        return tokens, None
    weights = [1.0] * len(tokens)
    for text, weight in context_terms:
        more = tokenize(text)
        tokens += more
        weights += [weight] * len(more)
    return tokens, weights


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def select_candidates(
    scores: npt.NDArray[np.float32],
    matched: BoolArray,
    mask: BoolArray | None,
    allowed: int,
    limit: int,
    *,
    by_vector: bool,
) -> IntArray:
    """Rows of the BM25 candidates: the `limit` best-scoring allowed chunks that hold a query
    term. When every allowed chunk fits in `limit` and vectors will score them, all of them are
    candidates, so a paraphrase sharing no term with its passage is still found."""
    if by_vector and allowed <= limit:
        return np.flatnonzero(mask) if mask is not None else np.arange(len(scores))
    rows = np.flatnonzero(matched if mask is None else matched & mask)
    if len(rows) > limit:
        rows = rows[np.argpartition(-scores[rows], limit - 1)[:limit]]
    return rows


def top_positions(scores: npt.NDArray[np.floating], k: int, rows: IntArray) -> IntArray:
    """Positions of the k best scores, best first; ties go to the lower row (deterministic)."""
    part = np.argpartition(-scores, k - 1)[:k] if len(scores) > k else np.arange(len(scores))
    order = np.lexsort((rows[part], -scores[part]))
    result: IntArray = part[order]
    return result


class HybridRetriever:
    """Searches a tenant's current index in `store` with the BM25-then-vectors cascade.

    `candidates` is how many BM25 results get a vector score; `fusion`, `vector_weight` and
    `rrf_k` set how the two rankings are combined (see retrieval.fusion); `relevance` scores each
    hit for the relevance gate (retrieval.relevance).

    A search takes two filters, both applied: `filters` (the caller's) and `defaults` (one the
    caller did not write, such as a user's department); each one's exclusions are counted apart.
    Both apply within what `viewer` may see (retrieval.access): the search runs on
    `TenantIndex.visible_to(viewer)`, the snapshot as if it held only the chunks the viewer may
    see (BM25 statistics included, so no score, count or rank depends on a hidden chunk), and
    without a viewer only the chunks without an access list are searched.
    """

    def __init__(
        self,
        store: IndexStore,
        *,
        candidates: int = DEFAULT_CANDIDATES,
        fusion: FusionMethod = DEFAULT_FUSION,
        vector_weight: float = DEFAULT_VECTOR_WEIGHT,
        rrf_k: float = DEFAULT_RRF_K,
        relevance: RelevanceModel = DEFAULT_MODEL,
    ) -> None:
        if candidates < 1:
            raise ValueError("candidates must be >= 1")
        self.store = store
        self.candidates = candidates
        self.fusion = fusion
        self.vector_weight = vector_weight
        self.rrf_k = rrf_k
        self.relevance = relevance

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
        """Top `top_k` chunks of `tenant` for the query; BM25 only when `query_vector` is None.

        `context_terms`: more texts whose words BM25 adds at a weight each, below the query's
        own 1 (a conversation's earlier turns, see `query_terms`)."""
        index = self.store.current(tenant)
        if index is None:
            return SearchResult([], 0, 0, _empty_timings())
        return self.search_index(
            index,
            query,
            query_vector,
            top_k=top_k,
            filters=filters,
            defaults=defaults,
            viewer=viewer,
            context_terms=context_terms,
        )

    def search_index(
        self,
        index: TenantIndex,
        query: str,
        query_vector: FloatArray | None,
        *,
        top_k: int = 5,
        filters: Filter | None = None,
        defaults: Filter | None = None,
        viewer: Viewer | None = None,
        context_terms: Sequence[tuple[str, float]] = (),
    ) -> SearchResult:
        """`search` on a given snapshot (what `search` does after picking the tenant's)."""
        started = time.perf_counter()
        index = index.visible_to(viewer)
        if len(index) == 0:
            return SearchResult([], 0, 0, _empty_timings(), index.version)
        mask = filters.mask(index.columns) if filters is not None else None
        requested = len(index) if mask is None else int(np.count_nonzero(mask))
        narrower = defaults.mask(index.columns) if defaults is not None else None
        if narrower is not None:
            mask = narrower if mask is None else mask & narrower
        allowed = len(index) if mask is None else int(np.count_nonzero(mask))
        timings = {"filter": _ms(started)}

        started = time.perf_counter()
        tokens, weights = query_terms(query, context_terms)
        scores, matched = index.bm25.scores(tokens, weights)
        rows = select_candidates(
            scores, matched, mask, allowed, self.candidates, by_vector=query_vector is not None
        )
        bm25 = scores[rows]
        is_match = matched[rows]
        timings["bm25"] = _ms(started)

        started = time.perf_counter()
        vector = (
            None if query_vector is None else candidate_scores(index.vectors, rows, query_vector)
        )
        timings["vector"] = _ms(started)

        started = time.perf_counter()
        fused = self._fuse(bm25, is_match, vector)
        best = top_positions(fused, top_k, rows)
        max_score = index.bm25.max_score(tokens, weights)
        hits = []
        for i in best:
            lexical = float(bm25[i]) if is_match[i] else None
            cosine = None if vector is None else float(vector[i])
            norm = normalised_bm25(lexical, max_score)
            relevance = None if cosine is None else self.relevance.score(norm, cosine)
            hits.append(
                _hit(index, int(rows[i]), float(fused[i]), lexical, cosine, norm, relevance)
            )
        timings["fusion"] = _ms(started)
        return SearchResult(
            hits,
            len(rows),
            allowed,
            timings,
            index.version,
            excluded_by_filters=len(index) - requested,
            excluded_by_defaults=requested - allowed,
        )

    def _fuse(
        self, bm25: npt.NDArray[np.float32], is_match: BoolArray, vector: FloatArray | None
    ) -> npt.NDArray[np.floating]:
        if vector is None:
            return bm25
        return fuse(
            bm25,
            is_match,
            vector,
            method=self.fusion,
            vector_weight=self.vector_weight,
            rrf_k=self.rrf_k,
        )

    def search_dense(
        self,
        tenant: str,
        query_vector: FloatArray,
        *,
        top_k: int = 10,
        filters: Filter | None = None,
        viewer: Viewer | None = None,
    ) -> SearchResult:
        """Vectors alone over the allowed chunks, through FAISS (exact, or HNSW when large)."""
        index = self.store.current(tenant)
        if index is None:
            return SearchResult([], 0, 0, _empty_timings())
        return dense_search(index, query_vector, top_k=top_k, filters=filters, viewer=viewer)


def dense_search(
    index: TenantIndex,
    query_vector: FloatArray,
    *,
    top_k: int = 10,
    filters: Filter | None = None,
    viewer: Viewer | None = None,
) -> SearchResult:
    """Dense-only top-k over a snapshot, within what `viewer` may see."""
    started = time.perf_counter()
    index = index.visible_to(viewer)
    if len(index) == 0:
        return SearchResult([], 0, 0, _empty_timings(), index.version)
    mask = filters.mask(index.columns) if filters is not None else None
    allowed = len(index) if mask is None else int(np.count_nonzero(mask))
    timings = _empty_timings()
    timings["filter"] = _ms(started)
    started = time.perf_counter()
    rows, scores = index.dense.search(query_vector, top_k, mask)
    timings["vector"] = _ms(started)
    hits = [
        _hit(index, int(r), float(s), None, float(s)) for r, s in zip(rows, scores, strict=True)
    ]
    return SearchResult(
        hits, allowed, allowed, timings, index.version, excluded_by_filters=len(index) - allowed
    )


def _empty_timings() -> dict[str, float]:
    return {"filter": 0.0, "bm25": 0.0, "vector": 0.0, "fusion": 0.0}


def _hit(
    index: TenantIndex,
    row: int,
    score: float,
    bm25: float | None,
    vector: float | None,
    bm25_norm: float | None = None,
    relevance: float | None = None,
) -> Hit:
    r = index.records
    return Hit(
        chunk_id=r.chunk_id[row],
        document_id=r.document_id[row],
        score=score,
        text=r.text[row],
        title=r.title[row],
        metadata=dict(r.metadata[row]),
        bm25_score=bm25,
        vector_score=vector,
        bm25_norm=bm25_norm,
        relevance=relevance,
    )
