"""The retrieval contract, proved against every backend: the embedded snapshots and Milvus
(Milvus Lite, the real engine), with the real embedding model and a real Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrieval.access import AccessList, Viewer
from retrieval.backends import RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.milvus import MilvusBackend
from retrieval.backends.milvus_expr import TypedKind
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.filters import FilterError, parse_filters
from retrieval.hybrid import HybridRetriever, SearchResult
from retrieval.relevance import DEFAULT_MODEL, DEFAULT_THRESHOLD
from retrieval.store import IndexStore
from tests.retrieval.backends_support import new_tenant
from tests.retrieval.conftest import CORPUS
from tests.support.servers import RedisServer

ALL = 50  # more than CORPUS: a search with this top_k returns every allowed chunk


# The third backend: Milvus with typed columns for the keys FILTERS range over, and the test's
# tenant in a collection of its own (every other tenant a test writes is in the shared one).
TYPED: dict[str, TypedKind] = {"year": "number", "date": "string", "lang": "string"}


@pytest.fixture(params=["embedded", "milvus", "milvus-typed-own-collection"])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, embedder: Embedder, tenant: str
) -> RetrievalBackend:
    if request.param.startswith("milvus"):
        milvus: MilvusBackend = request.getfixturevalue("milvus")
        if request.param == "milvus":
            return milvus
        return MilvusBackend(
            milvus.client,
            "typed",
            embedder,
            milvus.versions,
            typed_fields=TYPED,
            tenant_collections={tenant: "own"},
        )
    store = IndexStore(tmp_path / "indexes", embedder)
    return EmbeddedBackend(store, HybridRetriever(store))


@pytest.fixture
def tenant() -> str:
    return new_tenant()


def search(
    backend: RetrievalBackend,
    embedder: Embedder,
    tenant: str,
    query: str,
    top_k: int = ALL,
    **options: Any,
) -> SearchResult:
    return backend.search(tenant, query, embedder.embed([query])[0], top_k=top_k, **options)


def documents(result: SearchResult) -> set[str]:
    return {hit.document_id for hit in result.hits}


def test_the_best_passage_for_a_query_is_the_one_about_it(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    backend.upsert(tenant, CORPUS)
    for query, expected in [
        ("does aspirin prevent heart attacks", "aspirin"),
        ("memory safe systems language", "rust"),
        ("what causes ocean tides", "tides"),
    ]:
        assert search(backend, embedder, tenant, query, top_k=1).hits[0].document_id == expected


FILTERS: list[dict[str, Any]] = [
    {"lang": "en"},
    {"lang": {"$eq": "fr"}},
    {"year": 2019},
    {"year": 2019.0},
    {"peer_reviewed": True},
    {"peer_reviewed": 1},
    {"tags": "history"},
    {"tags": {"$in": ["software", "cooking"]}},
    {"lang": {"$in": ["fr", "it", "de"]}},
    {"year": {"$in": [79, 2015.0, "2019"]}},
    {"year": {"$gte": 2019}},
    {"year": {"$gt": 2019, "$lte": 2022}},
    {"year": {"$lt": 1900.5}},
    {"date": {"$gte": "2019-01-01"}},
    {"date": {"$lt": "2019"}},
    {"year": {"$gte": "2000"}},
    {"lang": "en", "tags": "medicine", "year": {"$gte": 2016}},
    {"missing": "x"},
    {"missing": {"$gt": 1}},
    {"missing": {"$in": ["a", 1, True]}},
    {"lang": "EN"},
]


@pytest.mark.parametrize("spec", FILTERS, ids=[str(f) for f in FILTERS])
def test_every_kind_of_filter_keeps_exactly_the_matching_documents(
    backend: RetrievalBackend, embedder: Embedder, tenant: str, spec: dict[str, Any]
) -> None:
    backend.upsert(tenant, CORPUS)
    filters = parse_filters(spec)
    expected = {d.id for d in CORPUS if filters.matches(d.metadata)}
    result = search(backend, embedder, tenant, "history of medicine", filters=filters)
    assert documents(result) == expected
    assert result.allowed == len(expected)
    assert result.excluded_by_filters == len(CORPUS) - len(expected)


def test_defaults_narrow_the_callers_filter_and_are_counted_apart(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    backend.upsert(tenant, CORPUS)
    result = search(
        backend,
        embedder,
        tenant,
        "medicine",
        filters=parse_filters({"lang": "en"}),
        defaults=parse_filters({"tags": "medicine"}),
    )
    assert documents(result) == {"aspirin", "statins", "insulin"}
    assert result.excluded_by_filters == 2  # fr, it
    assert result.excluded_by_defaults == 7


def test_two_tenants_with_identical_documents_never_see_each_other(
    backend: RetrievalBackend, embedder: Embedder
) -> None:
    first, second = new_tenant("a"), new_tenant("b")
    backend.upsert(first, CORPUS)
    backend.upsert(second, CORPUS)
    backend.upsert(first, [Document("aspirin", "Willow bark tea, rewritten.", "Changed")])
    backend.delete(first, ["rust"])
    theirs = search(backend, embedder, second, "aspirin heart attack")
    assert "rust" in documents(theirs) and len(theirs.hits) == len(CORPUS)
    assert any("low-dose aspirin" in hit.text for hit in theirs.hits)
    ours = search(backend, embedder, first, "aspirin heart attack")
    assert "rust" not in documents(ours) and len(ours.hits) == len(CORPUS) - 1
    assert not any("low-dose aspirin" in hit.text for hit in ours.hits)
    assert backend.stats(second).documents == len(CORPUS)
    assert backend.document_ids(first) == {d.id for d in CORPUS} - {"rust"}


def test_an_upsert_replaces_every_old_chunk_of_the_document(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    long_text = " ".join(f"word{i} about glaciers" for i in range(400))
    backend.upsert(tenant, [Document("long", long_text, "Glaciers"), CORPUS[0]])
    before = backend.stats(tenant)
    assert before.chunks > 3
    backend.upsert(tenant, [Document("long", "A short note on volcanoes.", "Volcanoes")])
    after = backend.stats(tenant)
    assert (after.documents, after.chunks) == (2, 2)
    hits = search(backend, embedder, tenant, "glaciers").hits
    assert {hit.chunk_id for hit in hits} == {"long#0", "aspirin#0"}
    assert all("glaciers" not in hit.text for hit in hits)


def test_a_delete_removes_every_chunk_and_a_missing_id_changes_nothing(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    long_text = " ".join(f"word{i} about glaciers" for i in range(400))
    backend.upsert(tenant, [Document("long", long_text), *CORPUS[:2]])
    result = backend.delete(tenant, ["long", "nope", "long"])
    assert result.documents == 1 and result.chunks > 3
    assert result.absent == ("nope",)  # the ids the tenant does not have, once each
    assert backend.stats(tenant).chunks == 2
    assert "long" not in documents(search(backend, embedder, tenant, "glaciers"))
    version = backend.version(tenant)
    nothing = backend.delete(tenant, ["nope", "long"])
    assert nothing.documents == 0 and backend.version(tenant) == version
    assert nothing.absent == ("nope", "long")


def test_an_empty_index_answers_with_nothing(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    result = search(backend, embedder, tenant, "anything", filters=parse_filters({"a": 1}))
    assert (result.hits, result.allowed, result.candidates) == ([], 0, 0)
    stats = backend.stats(tenant)
    assert (stats.documents, stats.chunks) == (0, 0)
    assert not backend.has_index(tenant)
    assert backend.document_ids(tenant) == set()


def test_unicode_text_and_values_are_kept_and_matched_literally(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    city = 'Zürich "alt" \\ 東京 𝄞'
    docs = [
        Document("cafe", "Le café naïve sert un thé ☕ à Zürich.", "Café 𝄞", {"city": city}),
        Document("plain", "A plain English note about tea.", "Tea", {"city": "Zurich"}),
    ]
    backend.upsert(tenant, docs)
    result = search(backend, embedder, tenant, "café thé", filters=parse_filters({"city": city}))
    assert documents(result) == {"cafe"}
    assert result.hits[0].text == docs[0].text and result.hits[0].title == "Café 𝄞"
    assert result.hits[0].metadata == {"city": city}
    ranged = search(
        backend, embedder, tenant, "tea", filters=parse_filters({"city": {"$gt": "Zz"}})
    )
    assert documents(ranged) == {"cafe"}  # "Zü" sorts after "Zz" in code points


def test_access_lists_hide_documents_from_viewers_they_do_not_name(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    board = AccessList(frozenset({"board"}))
    alice = AccessList(users=frozenset({'al"ice'}))
    docs = [
        Document("open", "Quarterly results for everyone.", "Open"),
        Document("board", "Quarterly results for the board.", "Board", access=board),
        Document("alice", "Quarterly results for alice.", "Alice", access=alice),
    ]
    backend.upsert(tenant, docs)

    def seen(viewer: Viewer | None) -> set[str]:
        return documents(search(backend, embedder, tenant, "quarterly results", viewer=viewer))

    assert seen(None) == {"open"}
    assert seen(Viewer("bob")) == {"open"}
    assert seen(Viewer("bob", frozenset({"board"}))) == {"open", "board"}
    assert seen(Viewer('al"ice')) == {"open", "alice"}
    assert seen(Viewer("alice")) == {"open"}


def test_the_version_changes_with_every_write(backend: RetrievalBackend, tenant: str) -> None:
    seen = [backend.version(tenant)]
    backend.upsert(tenant, CORPUS[:2])
    seen.append(backend.version(tenant))
    backend.upsert(tenant, CORPUS[:1])
    seen.append(backend.version(tenant))
    backend.delete(tenant, ["statins"])
    seen.append(backend.version(tenant))
    assert seen[0] == "0" and len(set(seen)) == 4
    assert backend.has_index(tenant)


HOSTILE_VALUES = [
    '") or tenant == "other',
    "' or 1==1 --",
    "x || true",
    "or 1==1",
    "back\\slash\\",
    '\\"',
    "nul\x00byte",
    "line\nbreak",
    "ünïcödé 𝄞",
    "x" * 5000,
    "",
]


@pytest.mark.parametrize("value", HOSTILE_VALUES, ids=range(len(HOSTILE_VALUES)))
def test_hostile_filter_values_match_literally_and_never_reach_another_tenant(
    backend: RetrievalBackend, embedder: Embedder, value: str
) -> None:
    ours, other = new_tenant("o"), new_tenant("x")
    backend.upsert(
        other, [Document("secret", "The other tenant's secret note.", "S", {"k": value})]
    )
    backend.upsert(ours, [Document("mine", "Our own note.", "M", {"k": "plain"})])
    if value:
        backend.upsert(ours, [Document("match", "Our matching note.", "M", {"k": value})])
    for spec in ({"k": value}, {"k": {"$in": [value, "plain"]}}, {value: value}):
        try:
            filters = parse_filters(spec)
        except FilterError:
            continue
        result = search(backend, embedder, ours, "secret note", filters=filters)
        expected = {d for d, meta in (("mine", {"k": "plain"}), ("match", {"k": value}))
                    if (d != "match" or value) and filters.matches(meta)}  # fmt: skip
        assert documents(result) == expected
    for spec in ({"k": {"$gte": value}}, {value or "k": {"$lt": value + "z"}}):
        try:
            result = search(backend, embedder, ours, "secret note", filters=parse_filters(spec))
        except FilterError:
            continue  # a clean refusal (a 400 on the request path)
        assert "secret" not in documents(result)


def test_a_vector_only_match_is_found_when_all_allowed_chunks_are_candidates(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    backend.upsert(tenant, CORPUS)
    result = search(backend, embedder, tenant, "baking bread at home", top_k=1)
    assert result.hits[0].document_id == "sourdough"
    assert result.candidates == len(CORPUS)


def test_exported_chunks_import_into_the_other_backend_unchanged(
    backend: RetrievalBackend, embedder: Embedder, tenant: str, tmp_path: Path,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    board = AccessList(frozenset({"board"}), frozenset({'al"ice'}))
    hidden = Document("hidden", "Board minutes.", "Minutes", {"k": ["a", "b"]}, access=board)
    backend.upsert(tenant, [*CORPUS, Document("long", " ".join(["glacier ice"] * 300)), hidden])
    batches = list(backend.export(tenant, batch=4))
    chunks = [c for b in batches for c in b.chunks]
    assert len(chunks) == backend.stats(tenant).chunks
    by_document: dict[str, int] = {}
    for number, b in enumerate(batches):
        for c in b.chunks:
            assert by_document.setdefault(c.document_id, number) == number  # whole documents
    assert all(np.isclose(np.linalg.norm(v), 1.0, atol=1e-4) for b in batches for v in b.vectors)
    store = IndexStore(tmp_path / "copy", embedder)
    target = EmbeddedBackend(store, HybridRetriever(store))
    for b in batches:
        target.import_chunks(tenant, b)
    assert target.stats(tenant).chunks == len(chunks)
    query = "does aspirin prevent heart attacks"
    assert search(target, embedder, tenant, query, top_k=1).hits[0].chunk_id == "aspirin#0"
    (copied,) = [c for c in chunks if c.document_id == "hidden"]
    assert (copied.access, copied.metadata, copied.title) == (board, {"k": ["a", "b"]}, "Minutes")
    viewer = Viewer("bob", frozenset({"board"}))
    assert "hidden" in documents(search(target, embedder, tenant, "minutes", viewer=viewer))
    assert "hidden" not in documents(search(target, embedder, tenant, "minutes"))


def test_hits_carry_the_relevance_the_gate_reads_on_either_backend(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    """The relevance gate drops passages that are not about the question at all; a backend
    whose hits had no relevance would let every one into the prompt."""
    backend.upsert(tenant, CORPUS)
    on_topic = search(backend, embedder, tenant, "what causes ocean tides", top_k=1).hits[0]
    off_topic = search(backend, embedder, tenant, "best pizza recipe with basil", top_k=1).hits[0]
    for hit in (on_topic, off_topic):
        assert hit.relevance is not None and hit.vector_score is not None
        assert hit.relevance == pytest.approx(DEFAULT_MODEL.score(0.0, hit.vector_score))
    assert on_topic.relevance >= DEFAULT_THRESHOLD > off_topic.relevance


def test_a_follow_ups_earlier_turns_weigh_in_at_their_weight_on_either_backend(
    backend: RetrievalBackend, embedder: Embedder, tenant: str
) -> None:
    """A conversation's earlier turns go to BM25 at a lower weight (issue 17's follow-up
    retrieval); the follow-up alone names nothing of what it asks about."""
    backend.upsert(tenant, CORPUS)
    follow_up = "and what makes that happen"
    for earlier, expected in [
        ("tell me about sourdough bread", "sourdough"),
        ("how do volcanoes like Vesuvius work", "volcano"),
    ]:
        result = backend.search(tenant, follow_up, None, top_k=1, context_terms=[(earlier, 0.5)])
        assert [hit.document_id for hit in result.hits] == [expected], earlier
    # At a weight that dwarfs the follow-up's own words, the earlier turn decides alone.
    alone = backend.search(tenant, "rise", None, top_k=3, context_terms=[("Vesuvius", 50.0)])
    assert alone.hits[0].document_id == "volcano"
