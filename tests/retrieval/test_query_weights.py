"""Weighted query tokens (a follow-up's own words at 1, earlier turns' lower): each token's
weight scales what rank-bm25 gives it, and a query without weights scores as it always did."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from retrieval.bm25 import BM25Index, count_terms
from retrieval.hybrid import query_terms
from retrieval.tokenize import tokenize
from tests.support.data import require_scifact


def _index(token_lists: list[list[str]]) -> BM25Index:
    vocab: dict[str, int] = {}
    return BM25Index(count_terms(token_lists, vocab), vocab)


def test_weighted_scores_are_the_weighted_sum_of_rank_bm25_per_token() -> None:
    scifact = require_scifact()
    with (scifact / "corpus.jsonl").open() as f:
        docs = [tokenize(f"{r['title']}\n{r['text']}") for r in map(json.loads, f)][:2000]
    with (scifact / "queries.jsonl").open() as f:
        claims = [tokenize(r["text"]) for r in map(json.loads, f)][:40]
    ours, reference = _index(docs), BM25Okapi(docs)
    for follow_up, earlier in zip(claims[::2], claims[1::2], strict=True):
        tokens = follow_up + earlier
        weights = [1.0] * len(follow_up) + [0.3] * len(earlier)
        expected = sum(
            (w * reference.get_scores([t]) for t, w in zip(tokens, weights, strict=True)),
            np.zeros(len(docs)),
        )
        got, matched = ours.scores(tokens, weights)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert (matched == (expected != 0)).all()
        # Without weights, the same tokens score exactly as before (bit for bit).
        plain, _ = ours.scores(tokens)
        np.testing.assert_array_equal(plain, ours.scores(tokens, None)[0])
        np.testing.assert_allclose(plain, reference.get_scores(tokens), rtol=1e-5, atol=1e-6)


def test_the_attainable_maximum_counts_each_token_at_its_weight() -> None:
    docs = [["vitamin", "skin"], ["season", "winter"], ["tide", "moon"], ["bread", "yeast"]]
    index = _index(docs)
    tokens, weights = ["season", "vitamin", "unknown"], [1.0, 0.5, 0.25]
    idf = index.idf_of(["season", "vitamin"])
    expected = (idf["season"] + 0.5 * idf["vitamin"] + 0.25 * index.unseen_idf) * (index.k1 + 1)
    assert index.max_score(tokens, weights) == pytest.approx(expected)
    assert index.max_score(tokens, [1.0, 1.0, 1.0]) == pytest.approx(index.max_score(tokens))
    assert (index.scores(tokens, weights)[0] <= index.max_score(tokens, weights)).all()


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.0], [1.0, -0.5], [1.0, float("nan")]])
def test_weights_must_be_parallel_positive_and_finite(weights: list[float]) -> None:
    index = _index([["a", "b"], ["b", "c"], ["c", "d"]])
    with pytest.raises(ValueError):
        index.scores(["a", "c"], weights)


def test_query_terms_weigh_the_context_below_the_query() -> None:
    assert query_terms("How does the season change it?") == (["season", "chang"], None)
    tokens, weights = query_terms(
        "How does the season change it?", [("vitamin D in the skin", 0.4), ("sunlight", 0.2)]
    )
    assert tokens == ["season", "chang", "vitamin", "skin", "sunlight"]
    assert weights == [1.0, 1.0, 0.4, 0.4, 0.2]
