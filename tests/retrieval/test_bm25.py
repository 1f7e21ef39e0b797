"""BM25 scores must equal rank-bm25's BM25Okapi on the same tokens."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import Stemmer
from rank_bm25 import BM25Okapi

from retrieval.bm25 import BM25Index, count_terms, drop_unused_terms
from retrieval.tokenize import tokenize
from tests.support.data import require_scifact


def _index(token_lists: list[list[str]]) -> BM25Index:
    vocab: dict[str, int] = {}
    tf = count_terms(token_lists, vocab)
    return BM25Index(tf, vocab)


def test_scores_equal_rank_bm25_on_full_scifact_corpus() -> None:
    scifact = require_scifact()
    with (scifact / "corpus.jsonl").open() as f:
        docs = [tokenize(f"{r['title']}\n{r['text']}") for r in map(json.loads, f)]
    with (scifact / "queries.jsonl").open() as f:
        queries = [tokenize(r["text"]) for r in map(json.loads, f)][:200]
    ours, reference = _index(docs), BM25Okapi(docs)
    assert any(v < 0 for v in reference.idf.values()) or reference.average_idf > 0
    for query in queries:
        expected = reference.get_scores(query)
        got, matched = ours.scores(query)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert (matched == (expected != 0)).all()


def test_negative_idf_floor_and_repeated_query_terms_match_rank_bm25() -> None:
    # Tiny corpora make common terms' IDF negative ("dog", floored at eps * average_idf) or
    # exactly zero ("cat", in half the documents).
    docs = [["cat", "dog"], ["dog", "bird"], ["dog", "cat", "cat"], ["fish"]]
    ours, reference = _index(docs), BM25Okapi(docs)
    assert reference.idf["dog"] == pytest.approx(0.25 * reference.average_idf)
    assert reference.idf["cat"] == 0.0
    for query in (["dog"], ["cat", "cat", "dog"], ["fish", "unknown"], []):
        np.testing.assert_allclose(ours.scores(query)[0], reference.get_scores(query), rtol=1e-6)
    # A zero score still counts as a match when the passage holds the term.
    assert ours.scores(["cat"])[1].tolist() == [True, False, True, False]


def test_terms_with_negative_idf_get_the_epsilon_floor() -> None:
    docs = [["a", "b"], ["a", "c"], ["a"]]
    ours, reference = _index(docs), BM25Okapi(docs)
    assert reference.idf["a"] == pytest.approx(0.25 * reference.average_idf)
    np.testing.assert_allclose(ours.scores(["a", "b"])[0], reference.get_scores(["a", "b"]))


def test_removing_documents_recomputes_idf_over_what_is_left() -> None:
    docs = [["x", "y"], ["y", "z"], ["z", "w"], ["w", "v"]]
    vocab: dict[str, int] = {}
    tf = count_terms(docs, vocab)
    kept, terms = drop_unused_terms(tf[[1, 2, 3]], list(vocab))
    assert "x" not in terms
    ours = BM25Index(kept, {t: i for i, t in enumerate(terms)})
    reference = BM25Okapi(docs[1:])
    np.testing.assert_allclose(ours.scores(["z", "w", "x"])[0], reference.get_scores(["z", "w"]))


def test_a_long_word_is_stemmed_and_the_stemmer_keeps_nothing_of_it() -> None:
    # PyStemmer caches every word it stems (10,000 per thread): a caller's 35,000-letter
    # "word" in a query kept 70 KiB a query, up to 0.7 GiB a search thread (a review's find).
    # Stemmed all the same (as the indexes built before were), by a stemmer that keeps nothing.
    words = [f"{n:05d}" + "a" * 10_000 + "ing" for n in range(300)]
    stems = Stemmer.Stemmer("english", 0).stemWords(words)
    assert stems[0] != words[0]
    assert tokenize("warm the stemmer up") == ["warm", "stemmer"]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for word, stem in zip(words, stems, strict=True):
            assert tokenize(f"tides {word}") == ["tide", stem]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, f"{grown} bytes kept for 300 words of 10,000 letters"
