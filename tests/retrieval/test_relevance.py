"""The relevance gate: normalised BM25, the relevance model, and the gate itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.bm25 import BM25Index, count_terms
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.hybrid import HybridRetriever
from retrieval.relevance import (
    DEFAULT_MODEL,
    DEFAULT_THRESHOLD,
    RelevanceGate,
    RelevanceModel,
    fit_logistic,
    gate,
    normalised_bm25,
)
from retrieval.store import IndexStore
from tests.support.fuzzing import examples


def _index(token_lists: list[list[str]]) -> BM25Index:
    vocab: dict[str, int] = {}
    return BM25Index(count_terms(token_lists, vocab), vocab)


def test_normalised_bm25_equals_the_hand_computed_value() -> None:
    docs = [["apple", "pie"], ["apple", "tart"], ["cherry", "pie", "pie"], ["plum"], ["fig"]]
    index = _index(docs)
    n, k1, b, avgdl = 5, 1.5, 0.75, 9 / 5
    idf_pie = math.log(n - 2 + 0.5) - math.log(2 + 0.5)  # in 2 of 5 documents
    idf_cherry = math.log(n - 1 + 0.5) - math.log(1 + 0.5)
    unseen = math.log(n + 0.5) - math.log(0.5)
    # "pie" twice, "cherry" once, "durian" is in no document.
    query = ["pie", "cherry", "pie", "durian"]
    maximum = (k1 + 1) * (2 * idf_pie + idf_cherry + unseen)
    assert index.max_score(query) == pytest.approx(maximum)
    assert index.max_score(query, count_unseen=False) == pytest.approx(
        (k1 + 1) * (2 * idf_pie + idf_cherry)
    )

    def weight(idf: float, tf: int, length: int) -> float:
        return idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / avgdl))

    score = 2 * weight(idf_pie, 2, 3) + weight(idf_cherry, 1, 3)
    scores, _ = index.scores(query)
    assert scores[2] == pytest.approx(score, rel=1e-5)
    assert normalised_bm25(float(scores[2]), index.max_score(query)) == pytest.approx(
        score / maximum, rel=1e-5
    )


@settings(max_examples=examples(200), deadline=None)
@given(
    docs=st.lists(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=6), min_size=1),
    query=st.lists(st.sampled_from("abcdefgxyz"), max_size=6),
)
def test_normalised_bm25_lies_in_the_unit_interval(docs: list[list[str]], query: list[str]) -> None:
    # Any corpus, including one or two documents where rank-bm25's IDFs turn negative.
    index = _index(docs)
    scores, matched = index.scores(query)
    top = index.max_score(query)
    assert all(s <= top + 1e-4 for s in scores.tolist()) or top == 0.0
    for score, hit in zip(scores.tolist(), matched.tolist(), strict=True):
        assert 0.0 <= normalised_bm25(score if hit else None, top) <= 1.0


def test_a_query_of_words_no_passage_holds_has_normalised_bm25_zero() -> None:
    index = _index([["apple"], ["pie"], ["plum"]])
    assert index.max_score(["durian"]) > 0  # counted at the unseen-term IDF...
    assert normalised_bm25(None, index.max_score(["durian"])) == 0.0  # ...but nothing matches
    assert index.max_score([]) == 0.0
    assert normalised_bm25(3.0, 0.0) == 0.0


def test_relevance_model_is_monotonic_and_bounded() -> None:
    model = RelevanceModel(intercept=-5.0, bm25_weight=4.0, cosine_weight=8.0)
    assert 0.0 < model.score(0.0, -1.0) < model.score(0.0, 0.5) < model.score(0.5, 0.5) < 1.0
    assert model.score(1e6, 1e6) == 1.0 and model.score(-1e6, -1e6) == 0.0  # no overflow
    got = model.scores(np.array([0.0, 0.5]), np.array([0.5, 0.5]))
    assert got.tolist() == pytest.approx([model.score(0.0, 0.5), model.score(0.5, 0.5)])


def test_fit_logistic_separates_two_clusters() -> None:
    rng = np.random.default_rng(0)
    relevant = rng.normal([0.4, 0.6], 0.05, size=(200, 2))
    noise = rng.normal([0.05, 0.1], 0.05, size=(100, 2))
    model = fit_logistic(
        np.vstack([relevant, noise]), np.array([True] * 200 + [False] * 100, dtype=np.bool_)
    )
    assert model.bm25_weight > 0 and model.cosine_weight > 0
    assert (
        min(model.score(*row) for row in relevant) > 0.5 > max(model.score(*row) for row in noise)
    )
    # Classes are weighted to half each: the boundary sits between the clusters, not near the
    # smaller one.
    assert model.score(0.225, 0.35) == pytest.approx(0.5, abs=0.25)


@dataclass(frozen=True)
class _Scored:
    name: str
    relevance: float | None


def test_gate_keeps_at_or_above_the_threshold_in_order() -> None:
    hits = [_Scored("a", 0.9), _Scored("b", 0.2), _Scored("c", 0.5), _Scored("d", None)]
    kept, dropped = gate(hits, 0.5)
    assert [h.name for h in kept] == ["a", "c", "d"]  # unscored hits are kept
    assert [h.name for h in dropped] == ["b"]
    assert gate(hits, 0.95) == ([hits[3]], hits[:3])
    assert gate([], 0.5) == ([], [])


def test_gate_threshold_can_be_overridden_per_request_or_switched_off() -> None:
    hits = [_Scored("a", 0.6), _Scored("b", 0.3)]
    configured = RelevanceGate(0.5)
    assert [h.name for h in configured.apply(hits).kept] == ["a"]
    assert [h.name for h in configured.apply(hits, threshold=0.1).kept] == ["a", "b"]
    assert configured.apply(hits, threshold=0.9).kept == []
    assert RelevanceGate(0.5, enabled=False).apply(hits).kept == hits
    with pytest.raises(ValueError):
        RelevanceGate(1.5)


def _search(store: IndexStore, embedder: Embedder, tenant: str, query: str) -> list[float]:
    result = HybridRetriever(store).search(tenant, query, embedder.embed([query])[0], top_k=3)
    for hit in result.hits:
        assert hit.bm25_norm is not None and 0.0 <= hit.bm25_norm <= 1.0
        assert hit.vector_score is not None and hit.relevance is not None
        assert hit.relevance == pytest.approx(DEFAULT_MODEL.score(hit.bm25_norm, hit.vector_score))
    return [h.relevance for h in result.hits if h.relevance is not None]


ON_TOPIC = [
    "Does daily aspirin reduce the risk of a heart attack?",
    "How do statins affect LDL cholesterol?",
    "Why did Vesuvius bury Pompeii?",
    "What causes ocean tides?",
]
OFF_TOPIC = [
    "What's the best way to negotiate a car lease?",
    "How do I configure a VPN on my router?",
    "Recommend a good fantasy novel series.",
]


def test_on_topic_queries_score_above_off_topic_ones(
    loaded: IndexStore, embedder: Embedder
) -> None:
    best_on = [max(_search(loaded, embedder, "acme", q)) for q in ON_TOPIC]
    best_off = [max(_search(loaded, embedder, "acme", q)) for q in OFF_TOPIC]
    assert min(best_on) > max(best_off)
    # The tuned threshold, calibrated on SciFact, separates them on this corpus too.
    assert min(best_on) >= DEFAULT_THRESHOLD > max(best_off)


def test_an_index_of_one_document_still_scores(tmp_path: Path, embedder: Embedder) -> None:
    store = IndexStore(tmp_path / "one", embedder)
    store.upsert("solo", [Document("tides", "Ocean tides are caused by the Moon's gravity.")])
    # With one passage every BM25 IDF is negative: BM25 says nothing, the cosine decides.
    (on,) = _search(store, embedder, "solo", "What causes the tides of the ocean?")
    (off,) = _search(store, embedder, "solo", "How do I bake sourdough bread?")
    assert on > off


def test_a_query_with_no_indexed_terms_relies_on_the_cosine(
    loaded: IndexStore, embedder: Embedder
) -> None:
    for query in ("zxqv wvvk plorb", "the of and"):  # unknown words; stop words only
        result = HybridRetriever(loaded).search("acme", query, embedder.embed([query])[0], top_k=3)
        assert result.hits, "every allowed chunk is a candidate when no term matches"
        assert all(h.bm25_score is None and h.bm25_norm == 0.0 for h in result.hits)
        kept, _ = gate(result.hits, DEFAULT_THRESHOLD)
        assert kept == []
