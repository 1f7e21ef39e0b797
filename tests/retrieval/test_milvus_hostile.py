"""Hostile input against the Milvus backend, on the real engine (Milvus Lite) with the real
embedding model: documents Milvus cannot store are refused before anything stored is touched,
filters either match exactly what the filter language says or are refused (FilterError, a 400
on the request path), never a server error, and nothing crosses tenants or access lists, also
when a write races another, when Redis is down, and when a move is cut short and run again."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.cli import backend as backend_cli
from retrieval.access import AccessList, Viewer
from retrieval.backends import BackendUnavailable, ChunkBatch
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.milvus import MilvusBackend
from retrieval.backends.router import BackendRouter, RedisOverrides
from retrieval.documents import Document, DocumentError
from retrieval.embeddings import Embedder
from retrieval.filters import FilterError, parse_filters
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore, IngestResult
from tests.retrieval.backends_support import milvus_backend, new_tenant
from tests.support.servers import RedisServer

ALL = 100


def rows(backend: MilvusBackend, tenant: str) -> dict[str, tuple[str, str, Any]]:
    """chunk id -> (text, title, metadata), straight from Milvus."""
    found = backend._query(
        tenant, f'tenant == "{tenant}"', ["chunk_id", "text", "title", "metadata"]
    )
    return {r["chunk_id"]: (r["text"], r["title"], r["metadata"]) for r in found}


def found(backend: MilvusBackend, tenant: str, query: str, **options: Any) -> set[str]:
    result = backend.search(tenant, query, None, top_k=ALL, **options)
    return {hit.document_id for hit in result.hits}


UNSTORABLE = {
    "lone surrogate in a metadata value": {"k": "\ud800"},
    "lone surrogate in a metadata list": {"k": ["fine", "\udfff"]},
    "lone surrogate in the heading path": {"heading_path": ["Top", "\ud800"]},
    "an integer beyond a float": {"k": 10**400},
}


@pytest.mark.parametrize("metadata", UNSTORABLE.values(), ids=list(UNSTORABLE))
def test_a_document_milvus_cannot_store_is_refused_and_the_stored_one_survives(
    milvus: MilvusBackend, metadata: dict[str, Any]
) -> None:
    tenant = new_tenant()
    milvus.upsert(tenant, [Document("victim", "The original text.", "Original", {"k": "v"})])
    before, version = rows(milvus, tenant), milvus.version(tenant)
    batch = [Document("fresh", "A good new document."), Document("victim", "New.", "N", metadata)]
    with pytest.raises(DocumentError):  # a 400, not a server error
        milvus.upsert(tenant, batch)
    assert rows(milvus, tenant) == before  # neither deleted nor half written
    assert milvus.version(tenant) == version


def test_a_passage_over_the_varchar_limit_is_refused_before_the_old_one_is_deleted(
    milvus: MilvusBackend,
) -> None:
    tenant = new_tenant()
    milvus.upsert(tenant, [Document("victim", "The original text.")])
    before = rows(milvus, tenant)
    with pytest.raises(DocumentError, match="too long"):
        milvus.upsert(tenant, [Document("victim", "x" * 65_536)])  # one 64 KiB "word"
    assert rows(milvus, tenant) == before
    milvus.upsert(tenant, [Document("victim", "é" * 32_767)])  # 65,534 bytes: fits
    assert rows(milvus, tenant)["victim#0"][0] == "é" * 32_767


def test_control_and_separator_characters_are_stored_exactly_and_searched(
    milvus: MilvusBackend,
) -> None:
    tenant = new_tenant()
    text, title = 'nul\x00marker\u2028line\u0085nel "q" \\ 𝄞', "t\x00i\u2029"
    meta = {"k": "x\x00y\u2028", "l": ['"', "\\", "\x01"]}
    milvus.upsert(tenant, [Document("odd", text, title, meta)])
    assert rows(milvus, tenant) == {"odd#0": (text, title, meta)}
    # Milvus's analyzer stops at a NUL: the words after one (here all, the title leads) are
    # still found by BM25.
    assert found(milvus, tenant, "marker") == {"odd"}
    assert found(milvus, tenant, "marker", filters=parse_filters({"k": "x\x00y\u2028"})) == {"odd"}
    assert found(milvus, tenant, "marker", filters=parse_filters({"l": "\x01"})) == {"odd"}


NUMBERS: list[Any] = [0, -0.0, 0.0, 1e308, -1e308, 2**70, 2**53 + 1, 5e-324, 1.5, True, 1]
HOSTILE_FILTERS: list[dict[str, Any]] = [
    {"n": 0},
    {"n": -0.0},
    {"n": {"$in": [-0.0, 7]}},
    {"n": {"$lte": -0.0}},
    {"n": 1e308},
    {"n": {"$gte": 1e308}},
    {"n": {"$lt": -1e308}},
    {"n": 2**70},
    {"n": {"$gt": 2**64}},
    {"n": 2**53},
    {"n": True},
    {"n": 1.0},
    {"n": {"$gt": 5e-324}},
    {"n": "0"},
    {"n": {"$in": list(range(-2500, 2500))}},
    {"s": {"$in": [f'v{i}"' for i in range(10_000)] + ['a"b']}},
    {"s": {"$gte": '\\") or tenant != "'}},
    {"s": {"$lt": "\\u0022 or 1==1"}},
    {"s": {"$gt": "a\u2028"}},
    {"s": "\\u0022"},
    {"k" * 10_000: "x"},
    {"s\x00s": "x"},
]
REFUSED: list[dict[str, Any]] = [
    {"n": 10**400},
    {"n": {"$in": [1, 10**400]}},
    {"n": {"$gt": 10**400}},
    {"n": {"$lt": -(10**400)}},
    {"n": {"$gte": float("nan")}},
    {"n": {"$lte": float("inf")}},
    {"s": {"$gt": "\ud800"}},
    {"s": {"$lt": "a\x00"}},
    {"s": {"$gt": "x" * 1025}},
    {'n"]': {"$gt": 1}},
    {"n.x": {"$gt": 1}},
]


@pytest.fixture(scope="module")
def numbers(milvus: MilvusBackend) -> tuple[str, dict[str, dict[str, Any]]]:
    """A tenant whose documents hold NUMBERS and hostile strings; another tenant holds the
    same values and a secret, which no filter may reach."""
    tenant, other = new_tenant("n"), new_tenant("x")
    strings = ['a"b', "a\\", "\\u0022", "a\u2028b", "é", "'", '\\") or tenant != "']
    docs = [Document(f"n{i}", f"number note {i}", "", {"n": v}) for i, v in enumerate(NUMBERS)]
    docs += [Document(f"s{i}", f"string note {i}", "", {"s": v}) for i, v in enumerate(strings)]
    milvus.upsert(tenant, docs)
    milvus.upsert(other, [Document(f"secret{d.id}", "secret note", "", d.metadata) for d in docs])
    return tenant, {d.id: d.metadata for d in docs}


@pytest.mark.parametrize("spec", HOSTILE_FILTERS, ids=[str(s)[:40] for s in HOSTILE_FILTERS])
def test_hostile_filters_keep_exactly_what_the_filter_language_says(
    milvus: MilvusBackend, numbers: tuple[str, dict[str, dict[str, Any]]], spec: dict[str, Any]
) -> None:
    tenant, metadata = numbers
    filters = parse_filters(spec)
    started = time.perf_counter()
    got = found(milvus, tenant, "number string note secret", filters=filters)
    assert time.perf_counter() - started < 10
    assert got == {d for d, meta in metadata.items() if filters.matches(meta)}


@pytest.mark.parametrize("spec", REFUSED, ids=[str(s)[:40] for s in REFUSED])
def test_filters_milvus_cannot_express_are_refused_as_filter_errors(
    milvus: MilvusBackend, numbers: tuple[str, dict[str, dict[str, Any]]], spec: dict[str, Any]
) -> None:
    tenant, _ = numbers
    with pytest.raises(FilterError):  # the request path answers 400
        milvus.search(tenant, "number note", None, top_k=ALL, filters=parse_filters(spec))


IDS = ['a"b', "a'b", "a\\b", "é𝄞", 'x"||tenant=="y', "x" * 256, "ß", "ss", "\u212b", "\u00c5"]


def test_hostile_document_ids_are_kept_apart_and_deleted_exactly(milvus: MilvusBackend) -> None:
    ours, theirs = new_tenant("o"), new_tenant("t")
    for tenant in (ours, theirs):
        milvus.upsert(tenant, [Document(i, f"text of {i}") for i in IDS])
    assert milvus.document_ids(ours) == set(IDS)  # no two ids collapse (Å and Å, ß and ss)
    gone = milvus.delete(ours, ['a"b', "\u212b", "nope", "x" * 100_000, "\x00", '"'])
    assert (gone.documents, gone.chunks) == (2, 2)
    assert milvus.document_ids(ours) == set(IDS) - {'a"b', "\u212b"}
    assert milvus.document_ids(theirs) == set(IDS)
    exported = {c.document_id for b in milvus.export(ours) for c in b.chunks}
    assert exported == set(IDS) - {'a"b', "\u212b"}


def test_access_lists_hold_for_hostile_viewers_and_never_cross_tenants(
    milvus: MilvusBackend,
) -> None:
    ours, theirs = new_tenant("o"), new_tenant("t")
    quoted = AccessList(frozenset({'g"])||public==true'}), frozenset({"u\\"}))
    docs = [
        Document("open", "Board minutes, open part."),
        Document("board", "Board minutes, board only.", access=AccessList(frozenset({"board"}))),
        Document("quoted", "Board minutes, quoted names.", access=quoted),
    ]
    milvus.upsert(ours, docs)
    many = frozenset(f"g{i}" for i in range(5000))
    assert found(milvus, ours, "board minutes", viewer=Viewer("bob", many)) == {"open"}
    assert found(milvus, ours, "board minutes", viewer=Viewer('g"])||public==true')) == {"open"}
    assert found(milvus, ours, "board minutes", viewer=Viewer("u\\")) == {"open", "quoted"}
    board = Viewer("bob", frozenset({"board"}))
    assert found(milvus, theirs, "board minutes", viewer=board) == set()
    assert found(milvus, ours, "board minutes", viewer=board) == {"open", "board"}


def test_concurrent_upserts_of_one_document_leave_exactly_one_whole_version(
    milvus: MilvusBackend,
) -> None:
    tenant = new_tenant()
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        try:
            for round_ in range(3):
                words = " ".join(f"w{writer}r{round_}n{n}" for n in range(400))
                milvus.upsert(tenant, [Document("same", words)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    stored = rows(milvus, tenant)
    assert len(stored) == 3  # 400 words: three passages, never two versions' worth
    assert len({text.split()[0].split("n")[0] for text, _, _ in stored.values()}) == 1
    assert milvus.version(tenant) == "9"


def test_a_write_while_redis_is_down_fails_loudly_and_reads_do_not_wait(
    tmp_path: Path, embedder: Embedder
) -> None:
    server = RedisServer()
    server.start()
    backend = milvus_backend(tmp_path, embedder, server.url)
    try:
        tenant = new_tenant()
        backend.upsert(tenant, [Document("doc", "Written while Redis is up.")])
        server.stop()
        # Refused whole (503 on the request path): never done with the version unchanged.
        for write in (
            lambda: backend.upsert(tenant, [Document("doc", "Written while Redis is down.")]),
            lambda: backend.delete(tenant, ["doc"]),
        ):
            with pytest.raises(BackendUnavailable, match="Redis"):
                write()
        started = time.perf_counter()
        assert backend.version(tenant) == "1"  # the last seen, at once
        assert found(backend, tenant, "written redis") == {"doc"}
        assert [text for text, _, _ in rows(backend, tenant).values()] == [
            "Written while Redis is up."
        ]
        assert time.perf_counter() - started < 5
        assert backend.version(new_tenant()) == "0"
    finally:
        backend.close()
        server.stop()


class _CutShort:
    """A target's import that fails on its `after`-th call (a move killed midway)."""

    def __init__(self, real: Callable[[str, ChunkBatch], IngestResult], after: int) -> None:
        self.real, self.after, self.calls = real, after, 0

    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        self.calls += 1
        if self.calls == self.after:
            raise ConnectionError("killed")
        return self.real(tenant, batch)


def test_a_move_cut_short_keeps_the_source_serving_and_a_rerun_completes_it(
    tmp_path: Path,
    embedder: Embedder,
    milvus: MilvusBackend,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tenant = new_tenant("m")
    store = IndexStore(tmp_path / "indexes", embedder)
    embedded = EmbeddedBackend(store, HybridRetriever(store))
    hidden = AccessList(frozenset({"board"}))
    docs = [Document(f"d{i}", f"Public note {i} on tides.") for i in range(6)]
    docs.append(Document("secret", "Board note on tides.", access=hidden))
    embedded.upsert(tenant, docs)
    overrides = RedisOverrides(redis_server.url, f"{tenant}:", reload_interval_s=0.0)
    router = BackendRouter(
        {"embedded": embedded, "milvus": milvus},
        overrides=overrides,
        fence=overrides.fence(),
    )
    monkeypatch.setattr(backend_cli, "backend_router", lambda: router)
    args = argparse.Namespace(tenant=tenant, to="milvus", batch=2)

    real = milvus.import_chunks
    cut = _CutShort(real, after=3)
    monkeypatch.setattr(milvus, "import_chunks", cut.import_chunks)
    with pytest.raises(ConnectionError):
        backend_cli.move(args)
    assert router.name_for(tenant) == "embedded"  # the source still serves, whole
    assert embedded.document_ids(tenant) == {d.id for d in docs}

    monkeypatch.setattr(milvus, "import_chunks", real)
    # Meanwhile the source lost a document the cut-short copy had already put in the target.
    copied = milvus.document_ids(tenant)
    assert "d0" in copied and copied < {d.id for d in docs}
    embedded.delete(tenant, ["d0"])
    docs = docs[1:]
    assert backend_cli.move(args) == 0
    assert router.name_for(tenant) == "milvus"
    assert milvus.document_ids(tenant) == {d.id for d in docs}
    assert milvus.stats(tenant).chunks == len(docs)  # nothing copied twice
    assert embedded.document_ids(tenant) == set()
    assert found(milvus, tenant, "note tides") == {d.id for d in docs} - {"secret"}
    board = Viewer("ann", frozenset({"board"}))
    assert "secret" in found(milvus, tenant, "note tides", viewer=board)
    assert backend_cli.move(args) == 0  # run twice: already there, nothing changes
    assert milvus.stats(tenant).chunks == len(docs)
    overrides.close()


def test_a_write_whose_insert_fails_puts_the_stored_document_back(
    milvus: MilvusBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Milvus deletes a document's old chunks before it inserts the new ones; an insert that
    fails then (a fault the engine cannot be made to produce on demand: a refused or timed-out
    call) must not lose what was stored."""
    tenant = new_tenant()
    words = " ".join(f"tide{i}" for i in range(400))
    milvus.upsert(tenant, [Document("doc", f"Stored first. {words}", metadata={"v": 1})])
    before = rows(milvus, tenant)
    assert len(before) == 3
    real_insert = milvus.client.insert
    calls: list[int] = []

    def failing_insert(collection: str, data: list[Any], **options: Any) -> Any:
        calls.append(len(data))
        if len(calls) == 1:  # the new chunks' insert; the putting back goes through
            raise ConnectionError("the insert was cut")
        return real_insert(collection, data, **options)

    monkeypatch.setattr(milvus.client, "insert", failing_insert)
    with pytest.raises(BackendUnavailable, match="Milvus"):
        milvus.upsert(tenant, [Document("doc", "Replacement, never stored.", metadata={"v": 2})])
    monkeypatch.setattr(milvus.client, "insert", real_insert)
    assert rows(milvus, tenant) == before
    assert found(milvus, tenant, "stored first tide7", filters=parse_filters({"v": 1})) == {"doc"}
