"""Filter syntax, and filters narrowing real searches."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from retrieval.embeddings import Embedder
from retrieval.filters import FilterError, MetadataColumns, parse_filters
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore

from .conftest import CORPUS


def _ids(retriever: HybridRetriever, embedder: Embedder, query: str, spec: Any) -> set[str]:
    result = retriever.search(
        "acme", query, embedder.embed([query])[0], top_k=50, filters=parse_filters(spec)
    )
    return {h.document_id for h in result.hits}


def _expected(spec: Any) -> set[str]:
    f = parse_filters(spec)
    return {d.id for d in CORPUS if f.matches(d.metadata)}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"lang": "fr"}, {"eiffel"}),
        ({"lang": {"$eq": "it"}}, {"volcano"}),
        ({"lang": {"$in": ["fr", "it"]}}, {"eiffel", "volcano"}),
        ({"year": {"$gte": 2020}}, {"statins", "python", "rust", "sourdough"}),
        ({"year": {"$gt": 1889, "$lt": 2012}}, {"jazz", "photosynthesis"}),
        ({"year": {"$lte": 1889}}, {"eiffel", "volcano"}),
        ({"tags": "cardiology"}, {"aspirin", "statins"}),
        ({"tags": {"$in": ["cooking", "sport"]}}, {"sourdough", "marathon"}),
        ({"tags": "history", "lang": "en"}, {"jazz"}),
        ({"tags": "medicine", "year": {"$lt": 2020}}, {"aspirin", "insulin"}),
        ({"peer_reviewed": True}, {"aspirin", "statins"}),
        ({"date": {"$gte": "2019-01-01"}}, {"sourdough"}),
    ],
)
def test_filters_narrow_search_results_to_matching_documents(
    loaded: IndexStore, embedder: Embedder, spec: Any, expected: set[str]
) -> None:
    retriever = HybridRetriever(loaded)
    assert _expected(spec) == expected
    for query in ("heart disease medicine", "history of music and cities", "language"):
        assert _ids(retriever, embedder, query, spec) <= expected
    # The filtered set is small, so every allowed chunk is a candidate: all come back.
    assert _ids(retriever, embedder, "anything at all", spec) == expected


def test_filter_on_a_key_no_document_has_gives_an_empty_result(
    loaded: IndexStore, embedder: Embedder
) -> None:
    retriever = HybridRetriever(loaded)
    result = retriever.search(
        "acme", "aspirin", embedder.embed(["aspirin"])[0], filters=parse_filters({"nope": "x"})
    )
    assert result.hits == [] and result.allowed == 0


def test_bool_and_number_never_equal_each_other() -> None:
    assert not parse_filters({"k": 1}).matches({"k": True})
    assert not parse_filters({"k": True}).matches({"k": 1})
    assert parse_filters({"k": 1}).matches({"k": 1.0})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"k": {"$ne": 1}}, "unknown operator '\\$ne'"),
        ({"$or": [{"a": 1}]}, "unsupported top-level operator '\\$or'"),
        ({"k": [1, 2]}, "'k': a list needs an operator"),
        ({"k": {"$in": "x"}}, "'k' \\$in: expected a list"),
        ({"k": {"$gt": True}}, "'k' \\$gt: a bound must be"),
        ({"k": {"$gte": [1]}}, "'k' \\$gte: expected a string, number or bool"),
        ({"k": {"$eq": {"a": 1}}}, "'k' \\$eq: expected"),
        ({"k": {}}, "'k': empty condition"),
        ({"k": None}, "'k' \\$eq: expected"),
        (["k"], "must be an object"),
    ],
)
def test_invalid_filter_syntax_raises_filter_error_naming_the_problem(
    spec: Any, message: str
) -> None:
    with pytest.raises(FilterError, match=message):
        parse_filters(spec)


def test_column_masks_agree_with_matching_one_document_at_a_time() -> None:
    rng = random.Random(7)
    metadata: list[dict[str, Any]] = []
    for _ in range(500):
        meta: dict[str, Any] = {}
        if rng.random() < 0.8:
            meta["n"] = rng.choice([rng.randint(0, 20), rng.random() * 20])
        if rng.random() < 0.7:
            meta["s"] = rng.choice(["a", "b", "c", "2020-01-02", "2021-06-30"])
        if rng.random() < 0.5:
            meta["tags"] = rng.sample(["x", "y", "z", "w"], rng.randint(0, 3))
        if rng.random() < 0.3:
            meta["flag"] = rng.random() < 0.5
        metadata.append(meta)
    columns = MetadataColumns(metadata)
    specs: list[dict[str, Any]] = [
        {"n": 5},
        {"n": {"$gte": 5, "$lt": 12.5}},
        {"n": {"$gt": 5}},
        {"n": {"$lte": 0}},
        {"s": {"$in": ["a", "c"]}},
        {"s": {"$gte": "2020", "$lt": "2021"}},
        {"tags": "x", "n": {"$lte": 10}},
        {"tags": {"$in": ["y", "w"]}},
        {"flag": False},
        {"n": {"$gt": "a"}},
    ]
    for spec in specs:
        f = parse_filters(spec)
        mask = f.mask(columns)
        assert mask is not None
        expected = np.array([f.matches(m) for m in metadata])
        assert (mask == expected).all(), spec
        assert 0 < expected.sum() < len(metadata) or spec == {"n": {"$gt": "a"}}


def test_what_the_filters_and_the_defaults_exclude_is_counted_apart(
    loaded: IndexStore, embedder: Embedder
) -> None:
    index = loaded.current("acme")
    assert index is not None and len(index) == len(CORPUS)  # one chunk per document
    retriever = HybridRetriever(loaded)
    vector = embedder.embed(["heart"])[0]
    english, medicine = parse_filters({"lang": "en"}), parse_filters({"tags": "medicine"})
    both = retriever.search("acme", "heart", vector, top_k=50, filters=english, defaults=medicine)
    # 10 of the 12 are in English; of those, 3 are tagged medicine.
    assert (both.allowed, both.excluded_by_filters, both.excluded_by_defaults) == (3, 2, 7)
    assert {h.document_id for h in both.hits} == {"aspirin", "statins", "insulin"}
    alone = retriever.search("acme", "heart", vector, top_k=50, defaults=medicine)
    assert (alone.allowed, alone.excluded_by_filters, alone.excluded_by_defaults) == (3, 0, 9)
    unfiltered = retriever.search("acme", "heart", vector, top_k=50)
    assert (unfiltered.allowed, unfiltered.excluded_by_filters) == (12, 0)
    assert unfiltered.excluded_by_defaults == 0
