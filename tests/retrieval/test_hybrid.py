"""The cascade: candidates from BM25 only, vector scores for those only, fusion, dense search."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.filters import parse_filters
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore

from .conftest import CORPUS


def test_candidate_count_caps_what_vectors_score(loaded: IndexStore, embedder: Embedder) -> None:
    retriever = HybridRetriever(loaded, candidates=3)
    query = "language for heart medicine and bread"
    result = retriever.search("acme", query, embedder.embed([query])[0], top_k=10)
    assert result.candidates <= 3 and len(result.hits) <= 3
    assert all(h.bm25_score is not None and h.vector_score is not None for h in result.hits)


def test_fusion_promotes_the_semantic_match_over_a_lexical_decoy(
    tmp_path: Path, embedder: Embedder
) -> None:
    store = IndexStore(tmp_path, embedder)
    store.upsert("t", [
        Document("decoy", "Heart heart heart: the word heart repeated in a poem about love."),
        Document("answer", "Myocardial infarction risk falls with daily low-dose aspirin."),
        *CORPUS[2:],
    ])  # fmt: skip
    query = "does aspirin lower heart attack risk"
    vector = embedder.embed([query])[0]
    retriever = HybridRetriever(store)
    assert retriever.search("t", query, vector).hits[0].document_id == "answer"
    scores = {h.document_id: h for h in retriever.search("t", query, vector, top_k=20).hits}
    assert scores["answer"].vector_score is not None and scores["decoy"].vector_score is not None
    assert scores["answer"].vector_score > scores["decoy"].vector_score


def test_bm25_only_search_without_a_query_vector(loaded: IndexStore) -> None:
    result = HybridRetriever(loaded).search("acme", "sourdough yeast", None, top_k=3)
    assert result.hits[0].document_id == "sourdough"
    assert all(h.vector_score is None and h.bm25_score for h in result.hits)


def test_paraphrase_without_shared_terms_is_found_in_a_small_filtered_set(
    loaded: IndexStore, embedder: Embedder
) -> None:
    query = "cardiac prevention pill"  # no term shared with the aspirin passage
    retriever = HybridRetriever(loaded)
    result = retriever.search(
        "acme", query, embedder.embed([query])[0], filters=parse_filters({"tags": "medicine"})
    )
    assert result.hits[0].document_id == "aspirin"
    assert result.hits[0].bm25_score is None


def test_dense_search_exact_and_approximate_agree_on_the_best_match(
    tmp_path: Path, embedder: Embedder
) -> None:
    exact = IndexStore(tmp_path / "exact", embedder)
    approximate = IndexStore(tmp_path / "approx", embedder, approximate_above=5)
    for store in (exact, approximate):
        store.upsert("t", CORPUS)
    index = approximate.current("t")
    assert index is not None and index.approximate is not None
    assert (approximate.root / "t" / index.version / "dense.faiss").exists()
    query = "volcanic eruption buried a Roman city"
    vector = embedder.embed([query])[0]
    for store in (exact, approximate):
        result = HybridRetriever(store).search_dense("t", vector, top_k=3)
        assert result.hits[0].document_id == "volcano"
        filtered = HybridRetriever(store).search_dense(
            "t", vector, top_k=3, filters=parse_filters({"lang": "en"})
        )
        assert filtered.hits and "volcano" not in {h.document_id for h in filtered.hits}
    reloaded = IndexStore(approximate.root, embedder).current("t")
    assert reloaded is not None and reloaded.approximate is not None


def test_results_are_deterministic_and_ordered_by_score(
    loaded: IndexStore, embedder: Embedder
) -> None:
    query = "programming languages"
    vector = embedder.embed([query])[0]
    retriever = HybridRetriever(loaded)
    first = retriever.search("acme", query, vector, top_k=5)
    second = retriever.search("acme", query, vector, top_k=5)
    assert [h.chunk_id for h in first.hits] == [h.chunk_id for h in second.hits]
    scores = [h.score for h in first.hits]
    assert scores == sorted(scores, reverse=True)
    assert {h.document_id for h in first.hits[:2]} == {"python", "rust"}
    assert np.isfinite(scores).all()
