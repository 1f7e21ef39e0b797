"""Milvus collections as a deployment lays them out: typed metadata columns that ranges read
instead of the JSON path (same answers, also for values of the wrong type, lists and hostile
strings), a collection of its own for a very large tenant (its chunks nowhere else, nothing of
another tenant's in it), and a collection created before the settings changed (kept as it is,
with a warning, and still answering right). Real engine (Milvus Lite), real embedding model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from retrieval.backends.milvus import MilvusBackend
from retrieval.backends.milvus_expr import TypedKind
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.filters import parse_filters
from tests.retrieval.backends_support import new_tenant

TYPED: dict[str, TypedKind] = {"year": "number", "date": "string"}
ALL = 100


def typed_backend(milvus: MilvusBackend, **options: Any) -> MilvusBackend:
    """Another backend on the same Milvus Lite server (one process per database file)."""
    options.setdefault("typed_fields", TYPED)
    return MilvusBackend(
        milvus.client,
        options.pop("collection", "typed"),
        milvus.embedder,
        milvus.versions,
        **options,
    )


class Filters:
    """Records every filter expression the backend sends to Milvus."""

    def __init__(self, backend: MilvusBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[str] = []
        for name in ("query", "search"):
            real = getattr(backend.client, name)
            monkeypatch.setattr(backend.client, name, self._spy(real))

    def _spy(self, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(str(kwargs.get("filter", "")))
            return real(*args, **kwargs)

        return call


# Values of `year` and `date` a careless or hostile client writes; each document has one.
ODD_VALUES: dict[str, dict[str, Any]] = {
    "int": {"year": 2019, "date": "2019-05-01"},
    "float": {"year": 2020.5, "date": "2020"},
    "negative-zero": {"year": -0.0, "date": ""},
    "huge": {"year": 1e308, "date": "9999-12-31"},
    "big-int": {"year": 2**63 + 1, "date": "z"},
    "bool": {"year": True, "date": False},
    "string-year": {"year": "2019", "date": 2019},
    "list": {"year": ["2018", "2022"], "date": ["2018", "2022"]},
    "quotes": {"year": 1999, "date": 'a" or tenant != "x'},
    "backslash": {"year": 1998, "date": "2019\\"},
    "unicode": {"year": 1997, "date": "二〇一九年 ☃ é"},
    "control": {"year": 1996, "date": "2019\x00\x1f"},
    "long": {"year": 1995, "date": "2" + "0" * 8_000},
    "missing": {},
}
RANGES: list[dict[str, Any]] = [
    {"year": {"$gte": 2019}},
    {"year": {"$gt": 0, "$lt": 2000.5}},
    {"year": {"$lte": 0}},
    {"year": {"$gt": 1e300}},
    {"date": {"$gte": "2019"}},
    {"date": {"$lt": "2"}},
    {"date": {"$gt": "a"}},
    {"date": {"$lte": ""}},
    {"year": {"$gte": "2000"}},  # a string bound on a number column: the JSON path
    {"date": {"$gte": 0}},  # and the other way round
]


def corpus() -> list[Document]:
    return [
        Document(name, f"A note on tides, case {name}.", metadata=meta)
        for name, meta in ODD_VALUES.items()
    ]


def expected(spec: dict[str, Any]) -> set[str]:
    """What the filter language says, for scalar values (a range reads no list's elements on
    Milvus: the documented difference from the embedded index, the same with or without typed
    columns)."""
    filters = parse_filters(spec)
    return {
        d.id
        for d in corpus()
        if not any(isinstance(v, list) for v in d.metadata.values()) and filters.matches(d.metadata)
    }


def found(backend: MilvusBackend, tenant: str, spec: dict[str, Any]) -> set[str]:
    result = backend.search(tenant, "tides note", None, top_k=ALL, filters=parse_filters(spec))
    return {hit.document_id for hit in result.hits}


@pytest.mark.parametrize("spec", RANGES, ids=[str(r) for r in RANGES])
def test_a_range_on_a_typed_key_reads_its_column_and_answers_as_the_json_path(
    milvus: MilvusBackend, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    typed = typed_backend(milvus)
    tenant = new_tenant()
    milvus.upsert(tenant, corpus())
    typed.upsert(tenant, corpus())
    spy = Filters(typed, monkeypatch)  # on the client both backends share
    through_typed = found(typed, tenant, spec)
    searched = " ".join(spy.seen)
    assert through_typed == found(milvus, tenant, spec) == expected(spec)
    ((key, condition),) = spec.items()
    bound = next(iter(condition.values()))
    column_kind = "number" if key == "year" else "string"
    bound_kind = "string" if isinstance(bound, str) else "number"
    if bound_kind == column_kind:
        assert f"f_{key} " in searched and f'metadata["{key}"]' not in searched
    else:
        assert f'metadata["{key}"]' in searched and f"f_{key} " not in searched


def test_typed_columns_hold_scalars_of_their_kind_and_mark_the_rest_absent(
    milvus: MilvusBackend,
) -> None:
    typed = typed_backend(milvus)
    tenant = new_tenant()
    typed.upsert(tenant, corpus())
    stored = {
        r["document_id"]: r
        for r in typed._query(
            tenant,
            f'tenant == "{tenant}"',
            ["document_id", "f_year", "h_year", "f_date", "h_date", "metadata"],
        )
    }
    assert set(stored) == set(ODD_VALUES)
    for name, meta in ODD_VALUES.items():
        row = stored[name]
        assert row["metadata"] == meta  # the JSON keeps every value as written
        year, date = meta.get("year"), meta.get("date")
        is_number = isinstance(year, int | float) and not isinstance(year, bool)
        assert row["h_year"] is is_number, name
        if is_number:
            assert row["f_year"] == float(year)
        assert row["h_date"] is isinstance(date, str), name
        if isinstance(date, str):
            assert row["f_date"] == date


def test_a_tenant_with_a_collection_of_its_own_is_stored_only_there(
    milvus: MilvusBackend, embedder: Embedder
) -> None:
    big, small = new_tenant("big"), new_tenant("small")
    backend = typed_backend(milvus, collection="shared_rows", tenant_collections={big: "big_rows"})
    same = [Document(f"d{i}", f"Identical note {i} about the tides.") for i in range(4)]
    backend.upsert(big, same)
    backend.upsert(small, same[:2])

    def tenants_in(collection: str) -> dict[str, int]:
        rows = backend.client.query(collection, filter='pk != ""', output_fields=["tenant"])
        counted: dict[str, int] = {}
        for row in rows:
            counted[row["tenant"]] = counted.get(row["tenant"], 0) + 1
        return counted

    assert tenants_in("big_rows") == {big: 4}
    assert tenants_in("shared_rows") == {small: 2}
    vector = embedder.embed(["tides"])[0]
    assert {h.document_id for h in backend.search(big, "tides", vector, top_k=ALL).hits} == {
        d.id for d in same
    }
    assert {h.document_id for h in backend.search(small, "tides", vector, top_k=ALL).hits} == {
        "d0",
        "d1",
    }
    assert backend.stats(big).chunks == 4 and backend.stats(small).chunks == 2
    assert backend.delete(big, ["d0"]).chunks == 1
    assert tenants_in("big_rows") == {big: 3}
    assert tenants_in("shared_rows") == {small: 2}  # a delete of one never touches the other
    assert {b.chunks[0].document_id for b in backend.export(big, batch=1)} == {"d1", "d2", "d3"}


def test_an_existing_collection_keeps_its_columns_and_says_so_when_settings_differ(
    milvus: MilvusBackend, caplog: pytest.LogCaptureFixture
) -> None:
    tenant = new_tenant()
    # The collection `milvus` writes to was created without typed columns.
    with caplog.at_level(logging.WARNING, logger="retrieval.backends.milvus"):
        late = typed_backend(milvus, collection=milvus.collection)
    assert "fixed when it is created" in caplog.text
    assert late.collection_of(tenant).typed == {}
    late.upsert(tenant, corpus())
    spec = {"year": {"$gte": 2019}}
    assert found(late, tenant, spec) == expected(spec)

    # And the other way: a collection with typed columns, settings that name none; writes
    # still fill its columns (Milvus Lite has no nullable fields) and ranges still use them.
    typed_backend(milvus, collection="typed_first")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="retrieval.backends.milvus"):
        later = typed_backend(milvus, collection="typed_first", typed_fields={})
    assert "fixed when it is created" in caplog.text
    assert later.collection_of(tenant).typed == TYPED
    later.upsert(tenant, corpus())
    assert found(later, tenant, spec) == expected(spec)


@pytest.mark.parametrize(
    "options",
    [
        {"collection": "has-dash"},
        {"collection": "1starts_with_digit"},
        {"tenant_collections": {"ok": 'x" or 1'}},
        {"tenant_collections": {"bad tenant": "fine"}},
        {"typed_fields": {'year"]': "number"}},
    ],
)
def test_names_milvus_or_the_expressions_cannot_take_are_refused_at_start(
    milvus: MilvusBackend, options: dict[str, Any]
) -> None:
    with pytest.raises(ValueError):
        typed_backend(milvus, **options)


def test_a_settings_file_with_a_bad_collection_or_key_does_not_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from app.settings import RetrievalSettings

    for bad in (
        {"milvus_tenant_collections": {"big": "no-dash"}},
        {"milvus_tenant_collections": {"a b": "fine"}},
        {"milvus_typed_fields": {"a.b": "number"}},
        {"milvus_typed_fields": {"year": "date"}},
        # More than a collection's 64 fields hold: refused here, not "cannot be reached" later.
        {"milvus_typed_fields": {f"k{i}": "number" for i in range(25)}},
    ):
        with pytest.raises(ValidationError):
            RetrievalSettings(**bad)
    assert (
        len(
            RetrievalSettings(
                milvus_typed_fields={f"k{i}": "number" for i in range(24)}
            ).milvus_typed_fields
        )
        == 24
    )
    assert RetrievalSettings().milvus_typed_fields == {
        "year": "number",
        "date": "string",
        "page": "number",
    }


def test_every_read_asks_for_strong_consistency(
    milvus: MilvusBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pymilvus creates collections "Bounded": on a Milvus server a search right after a
    # delete may still see the document, while the request is keyed on the version the
    # delete published, and its answer would be cached under it. Milvus Lite is strongly
    # consistent whatever is asked, so what is asked is what this checks.
    typed = typed_backend(milvus, collection=f"strong_{new_tenant()}")
    tenant = new_tenant()
    typed.upsert(tenant, corpus())
    asked: list[object] = []
    for name in ("query", "search"):
        real = getattr(typed.client, name)

        def spy(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            asked.append(kwargs.get("consistency_level"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(typed.client, name, spy)
    typed.delete(tenant, ["int"])
    assert "int" not in found(typed, tenant, {})
    # Asked of each read, it overrides the collection's level (an existing collection's too).
    # What a new collection is created with cannot be seen here: Milvus Lite describes every
    # collection as Strong.
    assert asked and set(asked) == {"Strong"}, asked


def test_which_documents_a_delete_finds_is_read_one_row_a_document(
    milvus: MilvusBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Milvus caps a query at 16,384 rows: the presence check read every chunk of up to 500
    # documents, so a batch delete of long documents reported some as not found and left
    # them in place (a review's reproducer: 61 of 304). One row a document (its first chunk)
    # is what the check reads now; documents of many chunks show it without 16,384 rows.
    small = typed_backend(milvus, collection=f"rows_{new_tenant()}", chunk_words=8, overlap_words=0)
    tenant = new_tenant()
    words = " ".join(f"tide{i} moon" for i in range(200))
    small.upsert(tenant, [Document(f"long{n}", words) for n in range(3)])
    rows: list[int] = []
    real = small.client.query

    def spy(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if "doc_key in" in str(kwargs.get("filter")) and kwargs.get("output_fields") == ["doc_key"]:
            rows.append(len(found))
        return found

    monkeypatch.setattr(small.client, "query", spy)
    result = small.delete(tenant, ["long0", "long1", "nope"])
    assert (result.documents, result.absent) == (2, ("nope",))
    assert result.chunks > 40  # long documents: many chunks each
    assert rows == [2], rows
    assert small.document_ids(tenant) == {"long2"}


def test_a_delete_that_fails_part_way_still_moves_the_version_on(
    milvus: MilvusBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delete goes to Milvus 500 documents a part: when a later part fails, what the first
    # took is gone, and answers cached under the version before it must not be served again.
    from pymilvus import MilvusException

    import retrieval.backends.milvus as backend_module
    from retrieval.backends import BackendUnavailable

    small = typed_backend(milvus, collection=f"parts_{new_tenant()}")
    tenant = new_tenant()
    small.upsert(tenant, [Document(name, f"Tides, case {name}.") for name in ("a", "b", "c")])
    before = small.version(tenant)
    parts = backend_module._parts
    monkeypatch.setattr(backend_module, "_parts", lambda items, size: parts(items, 1))
    deletes = 0
    real = small.client.delete

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        nonlocal deletes
        deletes += 1
        if deletes == 2:
            raise MilvusException(message="the second part failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(small.client, "delete", second_fails)
    with pytest.raises(BackendUnavailable):
        small.delete(tenant, ["a", "b"])
    left = small.document_ids(tenant)
    assert "c" in left and len(left & {"a", "b"}) == 1  # the first part went
    assert small.version(tenant) != before
