"""Documents are validated on construction; chunking keeps ids, metadata and overlap."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrieval.documents import (
    Document,
    DocumentError,
    check_metadata_limits,
    chunk_document,
)
from retrieval.embeddings import Embedder
from retrieval.store import IndexStore


# Nothing in these shows: controls, zero-width and format characters, a BOM, C1 controls.
@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n\t ",
        "\x00\x01",
        "\x01\x02\x03\x1b",
        "\u200b",
        "\ufeff \u2060",
        "\x85\xa0",
        "\u2066\u2069\xad\u061c\u180e\ufff9\u034f\ufe0f\u3164",
    ],
)
def test_empty_text_is_refused(text: str) -> None:
    with pytest.raises(DocumentError, match="empty text") as info:
        Document("d1", text)
    assert info.value.too_large is False


@pytest.mark.parametrize("doc_id", ["", "has space", "a#1", "x" * 257, "tab\there"])
def test_bad_ids_are_refused(doc_id: str) -> None:
    with pytest.raises(DocumentError, match="document id"):
        Document(doc_id, "text")


@pytest.mark.parametrize(
    "metadata",
    [{"k": {"nested": 1}}, {"k": [1, 2]}, {"k": None}, {"k": float("nan")}, {"$bad": 1}, {"": 1}],
)
def test_bad_metadata_is_refused(metadata: dict[str, object]) -> None:
    with pytest.raises(DocumentError, match="metadata"):
        Document("d1", "text", metadata=metadata)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({f"k{i}": i for i in range(65)}, "65 keys"),
        ({"k": "x" * 1025}, "1025 characters"),
        ({"k": ["x"] * 65}, "65 strings"),
        ({"k": ["ok", "x" * 1025]}, "1025 characters"),
        ({"k": 2**64}, "64 bits"),
        ({"k": -(2**63) - 1}, "64 bits"),
        ({"k": "\ud800"}, "lone surrogate"),
    ],
)
def test_metadata_over_the_limits_of_v1_documents_is_refused_whatever_the_way_in(
    metadata: dict[str, object], says: str
) -> None:
    # /v1/documents' schema declared these limits; uploads and `rag ingest` skipped them (a
    # 5,000-character value and 100 keys stored; 10**23 stored as the float 1e+23). Both check
    # a document's metadata with this now.
    document = Document("d1", "text", metadata=metadata)  # type: ignore[arg-type]
    with pytest.raises(DocumentError, match=says):
        check_metadata_limits(document.metadata)


def test_metadata_at_the_limits_is_kept_exactly() -> None:
    widest = {f"k{i}": "x" * 100 for i in range(63)}  # within the 8 KB of JSON
    check_metadata_limits(Document("d1", "text", metadata={**widest, "n": 1}).metadata)
    edges = {"a": "x" * 1024, "b": ["y"] * 64, "c": 2**64 - 1, "d": -(2**63), "e": True}
    document = Document("d1", "\u200dtext", metadata=edges)  # type: ignore[arg-type]
    check_metadata_limits(document.metadata)
    assert document.metadata == edges


def test_metadata_is_copied_so_the_caller_cannot_change_an_indexed_document() -> None:
    tags = ["a"]
    meta: dict[str, object] = {"tags": tags}
    doc = Document("d1", "text", metadata=meta)  # type: ignore[arg-type]
    tags.append("b")
    meta["x"] = 1
    assert doc.metadata == {"tags": ["a"]}


def test_chunks_overlap_and_carry_document_id_title_and_metadata() -> None:
    words = [f"w{i}" for i in range(25)]
    doc = Document("doc-1", " ".join(words), "Title", {"lang": "en"})
    chunks = chunk_document(doc, max_words=10, overlap_words=3)
    assert [c.chunk_id for c in chunks] == ["doc-1#0", "doc-1#1", "doc-1#2", "doc-1#3"]
    assert chunks[0].text.split() == words[0:10]
    assert chunks[1].text.split() == words[7:17]
    assert chunks[-1].text.split()[-1] == "w24"
    assert all(c.document_id == "doc-1" and c.title == "Title" for c in chunks)
    assert all(c.metadata == {"lang": "en"} for c in chunks)
    assert chunks[0].indexed_text.startswith("Title\n")


def test_a_short_document_is_one_chunk_with_its_original_formatting() -> None:
    doc = Document("d", "First line.\n\nSecond   line.")
    (chunk,) = chunk_document(doc)
    assert chunk.text == "First line.\n\nSecond   line."


def test_oversized_document_is_refused_as_too_large(tmp_path: Path, embedder: Embedder) -> None:
    store = IndexStore(tmp_path, embedder, max_document_chars=1000)
    with pytest.raises(DocumentError) as info:
        store.upsert("t", [Document("big", "word " * 201)])
    assert info.value.too_large is True
    assert store.version("t") == "0"


def test_long_document_under_the_limit_is_chunked_and_indexed(
    tmp_path: Path, embedder: Embedder
) -> None:
    store = IndexStore(
        tmp_path, embedder, max_document_chars=5000, chunk_words=50, overlap_words=10
    )
    text = " ".join(f"token{i}" for i in range(400))
    result = store.upsert("t", [Document("long", text)])
    assert result.chunks == 10
    index = store.current("t")
    assert index is not None and index.rows_by_document["long"] == list(range(10))


@pytest.mark.parametrize("field", ["id", "text", "title"])
def test_a_lone_surrogate_is_refused_before_it_reaches_the_index(field: str) -> None:
    # JSON may carry "\ud800"; stored as UTF-8 it would fail the snapshot's write (a 500).
    values = {"id": "d1", "text": "some text", "title": "t"}
    values[field] += "\ud800"
    with pytest.raises(DocumentError):
        Document(**values)
