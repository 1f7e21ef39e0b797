"""Access lists: validated strictly, stored on every chunk, and enforced inside the search, before
the top k are cut, on the BM25 and the dense side; old snapshots still load."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval import index as index_module
from retrieval.access import AccessColumns, AccessList, Viewer, may_see
from retrieval.documents import Document, DocumentError, chunk_document, parse_access
from retrieval.embeddings import Embedder
from retrieval.filters import parse_filters
from retrieval.hybrid import HybridRetriever, dense_search
from retrieval.index import TenantIndex, derive
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize

from .conftest import CORPUS

SECRET = Document(
    "merger-memo",
    "Project Nightingale merger terms: Acme buys Globex for 3 billion dollars in cash.",
    "Merger memo",
    access=AccessList(groups=frozenset({"finance"})),
)
PERSONAL = Document(
    "review-bob",
    "Performance review for Bob: exceeds expectations on the merger integration work.",
    "Review",
    access=AccessList(users=frozenset({"bob"})),
)


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ([], "must be an object"),
        ("finance", "must be an object"),
        ({"groups": "finance"}, "list of names"),
        ({"groups": None}, "list of names"),
        ({"groups": [], "users": []}, "at least one group or user"),
        ({}, "at least one group or user"),
        ({"groups": ["a"], "roles": ["x"]}, "only 'groups' and 'users'"),
        ({"groups": [""]}, "1-64 characters"),
        ({"groups": ["fin ance"]}, "without whitespace"),
        ({"groups": ["fin\u2003ance"]}, "without whitespace"),
        ({"groups": ["a,b"]}, "','"),
        ({"groups": ["a#b"]}, "'#'"),
        ({"groups": ["a\x00b"]}, "control"),
        ({"groups": ["a\x7f"]}, "control"),
        ({"users": ["x" * 65]}, "1-64 characters"),
        ({"users": [1]}, "user 'int'"),
        ({"users": [["bob"]]}, "user 'list'"),
        ({"groups": [f"g{i}" for i in range(33)]}, "at most 32 groups"),
    ],
)
def test_a_bad_access_list_is_refused_saying_why(value: object, says: str) -> None:
    with pytest.raises(DocumentError, match="access") as caught:
        parse_access(value)
    assert says in str(caught.value)


def test_a_huge_name_is_refused_without_being_echoed_whole() -> None:
    with pytest.raises(DocumentError) as caught:
        parse_access({"groups": ["g" * 1_000_000]})
    assert len(str(caught.value)) < 300


def test_valid_lists_parse_dedupe_and_round_trip() -> None:
    access = parse_access({"groups": ["finance", "finance", "légal"], "users": ["bob"]})
    assert access == AccessList(frozenset({"finance", "légal"}), frozenset({"bob"}))
    assert parse_access(access.to_json()) == access
    assert parse_access(None) is None
    with pytest.raises(DocumentError, match="AccessList or None"):
        Document("d", "text", access={"groups": ["x"]})  # type: ignore[arg-type]


@settings(max_examples=300)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=80),
        lambda inner: (
            st.lists(inner, max_size=40)
            | st.dictionaries(
                st.sampled_from(["groups", "users", "x"]) | st.text(max_size=5), inner
            )
        ),
        max_leaves=60,
    )
)
def test_any_json_value_is_an_access_list_or_a_document_error(value: object) -> None:
    try:
        access = parse_access(value)
    except DocumentError:
        return
    assert value is None or isinstance(access, AccessList)
    if access is not None:
        assert access.groups or access.users
        assert all(len(n) <= 64 and "," not in n for n in access.groups | access.users)


def test_who_may_see_what() -> None:
    listed = AccessList(frozenset({"finance"}), frozenset({"bob"}))
    assert may_see(None, None) and may_see(None, Viewer("anyone"))
    assert not may_see(listed, None)
    assert may_see(listed, Viewer("ann", frozenset({"finance", "hr"})))
    assert may_see(listed, Viewer("bob"))
    assert not may_see(listed, Viewer("ann", frozenset({"Finance", "hr"}))), "exact names only"
    assert not may_see(listed, Viewer("Bob"))


# -- stored on every chunk, snapshots old and new --------------------------------------------


def test_the_list_is_on_every_chunk_and_survives_a_reload(tmp_path: Path, embedder) -> None:
    long = dataclasses.replace(SECRET, text=" ".join(["merger"] * 500))
    assert len(chunk_document(long)) > 1
    assert {c.access for c in chunk_document(long)} == {SECRET.access}
    store = IndexStore(tmp_path, embedder)
    store.upsert("acme", [long, CORPUS[0]])
    reopened = IndexStore(tmp_path, embedder).current("acme")
    assert reopened is not None
    by_doc = dict(zip(reopened.records.chunk_id, reopened.records.access, strict=True))
    assert {a for c, a in by_doc.items() if c.startswith("merger-memo#")} == {SECRET.access}
    assert by_doc["aspirin#0"] is None


def test_a_snapshot_written_before_access_lists_loads_with_every_chunk_tenant_visible(
    tmp_path: Path, embedder
) -> None:
    store = IndexStore(tmp_path, embedder)
    version = store.upsert("acme", CORPUS[:3]).version
    chunks = tmp_path / "acme" / version / "chunks.json"
    columns = json.loads(chunks.read_text("utf-8"))
    del columns["access"]  # what the format wrote before this column existed
    chunks.write_text(json.dumps(columns), "utf-8")
    old = IndexStore(tmp_path, embedder).current("acme")
    assert old is not None and old.records.access == [None, None, None]
    hits = HybridRetriever(store).search_index(old, "aspirin", None, viewer=None).hits
    assert hits and hits[0].document_id == "aspirin"


# -- enforced inside the search --------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, embedder: Embedder) -> IndexStore:
    store = IndexStore(tmp_path_factory.mktemp("guarded"), embedder)
    store.upsert("acme", [*CORPUS, SECRET, PERSONAL])
    return store


def test_a_restricted_chunk_never_takes_a_slot_from_someone_it_does_not_admit(
    guarded: IndexStore, embedder: Embedder
) -> None:
    retriever = HybridRetriever(guarded)
    # Its exact text, the best match on both sides; one word that a visible chunk holds too.
    query = SECRET.text + " aspirin"
    vector = embedder.embed([query])[0]
    finance = Viewer("ann", frozenset({"finance"}))
    assert retriever.search("acme", query, vector, top_k=1, viewer=finance).hits[0].document_id == (
        "merger-memo"
    )
    for viewer in (Viewer("carl"), Viewer("carl", frozenset({"sales"})), None):
        for result in (
            retriever.search("acme", query, vector, top_k=1, viewer=viewer),
            retriever.search("acme", query, None, top_k=1, viewer=viewer),
            retriever.search_dense("acme", vector, top_k=1, viewer=viewer),
        ):
            assert len(result.hits) == 1, "the slot goes to a visible chunk"
            assert result.hits[0].document_id not in {"merger-memo", "review-bob"}
            # Counts cover only what the viewer sees: as if the hidden chunks did not exist.
            assert result.allowed == len(CORPUS)
            assert result.excluded_by_filters == 0


def test_counts_under_filters_say_nothing_of_hidden_chunks(
    guarded: IndexStore, embedder: Embedder
) -> None:
    retriever = HybridRetriever(guarded)
    english = parse_filters({"lang": "en"})
    seen = retriever.search("acme", "merger", None, top_k=20, filters=english, viewer=Viewer("x"))
    everyone = sum(1 for d in CORPUS if d.metadata.get("lang") == "en")
    assert (seen.allowed, seen.excluded_by_filters) == (everyone, len(CORPUS) - everyone)
    bob = retriever.search("acme", "merger", None, top_k=20, viewer=Viewer("bob"))
    assert {h.document_id for h in bob.hits} == {"review-bob"}
    assert bob.allowed == len(CORPUS) + 1


def test_an_access_change_by_re_ingest_applies_to_the_next_search(
    tmp_path: Path, embedder: Embedder
) -> None:
    store = IndexStore(tmp_path, embedder)
    retriever = HybridRetriever(store)
    store.upsert("acme", [*CORPUS[:4], SECRET])
    carl = Viewer("carl")
    assert "merger-memo" not in {
        h.document_id for h in retriever.search("acme", "merger", None, viewer=carl).hits
    }
    store.upsert("acme", [dataclasses.replace(SECRET, access=None)])
    assert retriever.search("acme", "merger", None, viewer=carl).hits[0].document_id == (
        "merger-memo"
    )
    store.upsert("acme", [dataclasses.replace(SECRET, access=AccessList(users=frozenset({"x"})))])
    assert "merger-memo" not in {
        h.document_id for h in retriever.search("acme", "merger", None, viewer=carl).hits
    }


def test_scores_do_not_tell_whether_hidden_chunks_hold_a_word(
    tmp_path: Path, embedder: Embedder
) -> None:
    store = IndexStore(tmp_path, embedder)
    retriever = HybridRetriever(store)
    store.upsert("acme", CORPUS)
    query = "aspirin heart attack"
    vector = embedder.embed([query])[0]
    before = retriever.search("acme", query, vector, top_k=3, viewer=Viewer("carl"))
    hidden = Document(
        "layoffs",
        "Aspirin heart attack layoffs: aspirin aspirin.",
        access=AccessList(groups=frozenset({"hr"})),
    )
    store.upsert("acme", [hidden])
    after = retriever.search("acme", query, vector, top_k=3, viewer=Viewer("carl"))
    assert [(h.chunk_id, h.bm25_score, h.score, h.relevance) for h in after.hits] == [
        (h.chunk_id, h.bm25_score, h.score, h.relevance) for h in before.hits
    ]
    member = retriever.search("acme", query, vector, top_k=3, viewer=Viewer("x", frozenset({"hr"})))
    assert "layoffs" in {h.document_id for h in member.hits}


def test_the_scope_is_what_decides_the_visible_rows_and_no_more() -> None:
    finance = AccessList(groups=frozenset({"finance"}))
    columns = AccessColumns([None, finance, AccessList(users=frozenset({"bob"}))])
    assert AccessColumns([None, None]).scope(Viewer("a", frozenset({"g"}))) is None
    ann = columns.scope(Viewer("ann", frozenset({"finance", "unused"})))
    assert ann == columns.scope(Viewer("dora", frozenset({"finance"}))), "same rows, same scope"
    assert ann == {"groups": ["finance"], "user": None}
    assert columns.scope(Viewer("bob")) == {"groups": [], "user": "bob"}
    assert columns.scope(Viewer("carl")) == columns.scope(None)


# -- the property: for any lists and any viewer, nothing hidden comes back --------------------

NAMES = ["finance", "hr", "legal", "ann", "bob"]
QUERIES = ["heart attack aspirin", "programming language memory", "merger", "history of Paris"]


@pytest.fixture(scope="module")
def material(embedder: Embedder) -> tuple[list, list[list[str]], np.ndarray, np.ndarray]:
    chunks = [c for d in CORPUS for c in chunk_document(d)]
    tokens = [tokenize(c.indexed_text) for c in chunks]
    vectors = embedder.embed([c.indexed_text for c in chunks])
    return chunks, tokens, vectors, embedder.embed(QUERIES)


access_lists = st.none() | st.builds(
    lambda g, u: AccessList(frozenset(g), frozenset(u)) if g or u else None,
    st.sets(st.sampled_from(NAMES[:3]), max_size=2),
    st.sets(st.sampled_from(NAMES[3:]), max_size=1),
)
viewers = st.none() | st.builds(
    Viewer, st.sampled_from([*NAMES[3:], "carl"]), st.frozensets(st.sampled_from(NAMES[:3]))
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lists=st.lists(access_lists, min_size=len(CORPUS), max_size=len(CORPUS)),
    viewer=viewers,
    query=st.integers(0, len(QUERIES) - 1),
    top_k=st.integers(1, 12),
    lang=st.sampled_from([None, "en"]),
)
def test_a_search_never_returns_a_chunk_its_viewer_may_not_see(
    material, loaded: IndexStore, lists, viewer, query, top_k, lang
) -> None:
    chunks, tokens, vectors, query_vectors = material
    chunks = [dataclasses.replace(c, access=a) for c, a in zip(chunks, lists, strict=True)]
    index: TenantIndex = derive(
        None,
        "1",
        remove=set(),
        chunks=chunks,
        tokens=tokens,
        vectors=vectors,
        approximate_above=10**6,
    )
    allowed = {c.chunk_id for c in chunks if may_see(c.access, viewer)}
    filters = parse_filters({"lang": lang} if lang else None)
    passing = {c.chunk_id for c in chunks if c.chunk_id in allowed and filters.matches(c.metadata)}
    retriever = HybridRetriever(loaded)
    text, vector = QUERIES[query], query_vectors[query]
    for result in (
        retriever.search_index(index, text, vector, top_k=top_k, filters=filters, viewer=viewer),
        retriever.search_index(index, text, None, top_k=top_k, filters=filters, viewer=viewer),
        dense_search(index, vector, top_k=top_k, filters=filters, viewer=viewer),
    ):
        returned = {h.chunk_id for h in result.hits}
        assert returned <= passing
        assert result.allowed == len(passing)
        assert result.excluded_by_filters == len(allowed) - len(passing)
    # Stronger: the search is exactly the one over an index of only the visible chunks, scores
    # included (BM25's IDF and lengths too), so nothing of a hidden chunk shows in a result.
    seen = [i for i, c in enumerate(chunks) if c.chunk_id in allowed]
    alone = derive(
        None,
        "1",
        remove=set(),
        chunks=[dataclasses.replace(chunks[i], access=None) for i in seen],
        tokens=[tokens[i] for i in seen],
        vectors=vectors[seen].reshape(len(seen), -1),
        approximate_above=10**6,
    )
    for with_vector in (vector, None):
        got = retriever.search_index(
            index, text, with_vector, top_k=top_k, filters=filters, viewer=viewer
        )
        want = retriever.search_index(alone, text, with_vector, top_k=top_k, filters=filters)
        assert [h.chunk_id for h in got.hits] == [h.chunk_id for h in want.hits]
        assert [h.score for h in got.hits] == pytest.approx([h.score for h in want.hits])
        assert [h.bm25_score for h in got.hits] == pytest.approx([h.bm25_score for h in want.hits])
        assert (got.allowed, got.candidates) == (want.allowed, want.candidates)


# -- views: built once, bounded, counted -------------------------------------------------------


def restricted_index(material, groups: int) -> TenantIndex:
    """The corpus with each chunk but the first restricted to one of `groups` groups."""
    chunks, tokens, vectors, _ = material
    lists = [AccessList(groups=frozenset({f"g{i % groups}"})) for i in range(len(chunks))]
    return derive(
        None,
        "1",
        remove=set(),
        chunks=[
            dataclasses.replace(c, access=None if i == 0 else lists[i])
            for i, c in enumerate(chunks)
        ],
        tokens=tokens,
        vectors=vectors,
        approximate_above=10**6,
    )


def test_views_are_counted_and_bounded_by_count_and_bytes(material, monkeypatch) -> None:
    index = restricted_index(material, groups=12)
    assert index.resident_bytes == index._own_bytes() > index.own_nbytes, "no view yet"
    first = index.visible_to(Viewer("u", frozenset({"g1"})))
    assert index.resident_bytes == index._own_bytes() + first.resident_bytes
    # A view holds its own arrays and lists; the texts and metadata are its snapshot's.
    assert first.own_nbytes < first.resident_bytes < index._own_bytes() - index.own_nbytes
    before = first.resident_bytes
    query_vectors = material[3]
    dense_search(index, query_vectors[0], viewer=Viewer("u", frozenset({"g1"})))
    assert first.resident_bytes == before + first.vectors.nbytes, "its FAISS copy counts"
    assert index.resident_bytes == index._own_bytes() + first.resident_bytes, "and at once"
    for n in range(12):
        index.visible_to(Viewer("u", frozenset({f"g{n}"})))
        assert 1 <= len(index._views) <= index_module.MAX_VIEWS
        views_bytes = index.resident_bytes - index._own_bytes()
        assert views_bytes <= index_module.VIEW_BUDGET * index.own_nbytes
    assert len(index._views) < 12, "the byte budget evicted"
    # With bytes to spare, the count bounds them.
    monkeypatch.setattr(index_module, "VIEW_BUDGET", 1e9)
    for n in range(12):
        index.visible_to(Viewer("w", frozenset({f"g{n}", "g0"})))
    assert len(index._views) == index_module.MAX_VIEWS
    # A budget of the two newest views' bytes keeps those two only.
    older = index.visible_to(Viewer("u", frozenset({"g0", "g1"})))
    last = index.visible_to(Viewer("u", frozenset({"g0", "g2"})))
    pair = (older.resident_bytes + last.resident_bytes) / index.own_nbytes
    monkeypatch.setattr(index_module, "VIEW_BUDGET", pair)
    assert index.visible_to(Viewer("v", frozenset({"g0", "g2"}))) is last
    assert list(index._views.values()) == [older, last]
    assert index.resident_bytes == index._own_bytes() + older.resident_bytes + last.resident_bytes
    # A budget smaller than one view still keeps the newest, so its next search reuses it.
    monkeypatch.setattr(index_module, "VIEW_BUDGET", 0.0)
    again = index.visible_to(Viewer("u", frozenset({"g2"})))
    assert index.visible_to(Viewer("v", frozenset({"g2"}))) is again
    assert len(index._views) == 1


def test_a_view_does_not_keep_a_let_go_snapshot_alive(material) -> None:
    # A view tells its snapshot what it built (the loaded-snapshot budget counts it), so it
    # points back to it: weakly, or a snapshot the budget let go would wait for the cyclic
    # garbage collector, however large, while it still counted as freed.
    index = restricted_index(material, groups=3)
    view = index.visible_to(Viewer("u", frozenset({"g1"})))
    dense_search(index, material[3][0], viewer=Viewer("u", frozenset({"g1"})))
    snapshot = weakref.ref(index)
    gc.disable()
    try:
        del index
        assert snapshot() is None, "freed as its last reference went"
    finally:
        gc.enable()
    assert len(view) > 0 and view.resident_bytes > 0
    view._grew()  # a search of a view whose snapshot is gone: nothing to tell


def test_concurrent_searches_of_one_visible_set_build_one_view(material, monkeypatch) -> None:
    index = restricted_index(material, groups=3)
    builds = []
    real = index_module.drop_unused_terms

    def slow(*args):  # a build long enough for every thread to arrive while it runs
        builds.append(1)
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(index_module, "drop_unused_terms", slow)
    start = threading.Barrier(6)

    def search(_: int) -> TenantIndex:
        start.wait()
        return index.visible_to(Viewer("u", frozenset({"g1"})))

    with ThreadPoolExecutor(6) as pool:
        views = list(pool.map(search, range(6)))
    assert len(builds) == 1
    assert all(view is views[0] for view in views)
    assert len(views[0]) < len(index)


def test_nothing_visible_is_a_search_with_no_hits(material, loaded: IndexStore) -> None:
    """An index of only hidden chunks answers as an empty one does: no hit, nothing counted,
    no sign that the hidden chunks exist."""
    chunks, tokens, vectors, query_vectors = material
    hidden = derive(
        None,
        "1",
        remove=set(),
        chunks=[
            dataclasses.replace(c, access=AccessList(groups=frozenset({"hr"}))) for c in chunks
        ],
        tokens=tokens,
        vectors=vectors,
        approximate_above=10**6,
    )
    empty = derive(
        None,
        "1",
        remove=set(),
        chunks=[],
        tokens=[],
        vectors=vectors[:0],
        approximate_above=10**6,
    )
    retriever = HybridRetriever(loaded)
    viewer = Viewer("carl")

    def shape(result) -> tuple:
        return (
            result.hits,
            result.allowed,
            result.candidates,
            result.excluded_by_filters,
            result.excluded_by_defaults,
            result.version,
            sorted(result.timings_ms),
        )

    for vector in (query_vectors[0], None):
        got = retriever.search_index(hidden, QUERIES[0], vector, viewer=viewer)
        want = retriever.search_index(empty, QUERIES[0], vector, viewer=viewer)
        assert shape(got) == shape(want)
        assert got.hits == [] and got.allowed == 0
    assert shape(dense_search(hidden, query_vectors[0], viewer=viewer)) == shape(
        dense_search(empty, query_vectors[0], viewer=viewer)
    )
    assert hidden.visible_to(viewer).bm25.idf_of(tokenize(QUERIES[0])) == empty.bm25.idf_of(
        tokenize(QUERIES[0])
    )
