"""Milvus can refuse a BM25 search while rows are being deleted ("Invalid sparse row: negative
value": its statistics race the delete, a term's IDF comes out negative). It was seen once in CI
during an upsert, and not again in 9,000 searches beside 4,000 upserts: the real Milvus Lite
cannot be made to do it on demand, so its refusal (the exception and message it raised) is put
in front of a real Milvus Lite collection's search. The search is asked again; a refusal that
lasts is still a 503 (BackendUnavailable), never wrong hits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymilvus.exceptions import MilvusException

from bench.milvus_bench import ONE_CHUNK, TENANT, TableEmbedder, milvus_backend
from retrieval.backends import BackendUnavailable
from retrieval.backends.milvus import MilvusBackend, connect
from retrieval.documents import Document

REFUSAL = (
    'Assert "element.val >= 0"  => Invalid sparse row: negative value at '
    "/workspace/milvus-lite/thirdparty/milvus/internal/core/src/common/Utils.h:271\n: segcore error"
)
WORDS = ["cell", "protein", "gene", "tumor", "dose", "risk", "trial", "brain", "virus", "memory"]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[MilvusBackend]:
    client = connect(str(tmp_path / "milvus.db"))
    milvus = milvus_backend(client, "idf", TableEmbedder(), **ONE_CHUNK)
    docs = [
        Document(id=f"d{i}", text=" ".join(WORDS[(i + k) % 10] for k in range(6)))
        for i in range(20)
    ]
    milvus.upsert(TENANT, docs)
    yield milvus
    client.close()


def refusing(backend: MilvusBackend, times: int) -> list[int]:
    """The next ``times`` BM25 searches refused as Milvus refuses them; the BM25 searches
    asked, counted."""
    search = backend.client.search
    calls: list[int] = []

    def refused_first(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("anns_field") == "sparse":
            calls.append(1)
            if len(calls) <= times:
                raise MilvusException(code=2000, message=REFUSAL)
        return search(*args, **kwargs)

    backend.client.search = refused_first
    return calls


def ids(backend: MilvusBackend) -> list[str]:
    vector = TableEmbedder().embed(["cell protein"])[0]
    return [h.document_id for h in backend.search(TENANT, "cell protein", vector, top_k=5).hits]


def test_a_search_refused_for_a_negative_idf_is_asked_again_and_answered(backend) -> None:
    expected = ids(backend)
    assert len(expected) == 5
    calls = refusing(backend, 2)
    assert ids(backend) == expected
    assert len(calls) == 3  # two refusals, then the answer


def test_a_refusal_that_lasts_is_a_503_not_an_empty_answer(backend) -> None:
    calls = refusing(backend, 100)
    with pytest.raises(BackendUnavailable):
        ids(backend)
    assert len(calls) == 3


def test_other_store_errors_are_not_asked_again(backend) -> None:
    search = backend.client.search
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("anns_field") != "sparse":
            return search(*args, **kwargs)
        calls.append(1)
        raise MilvusException(code=1, message="segcore error: something else")

    backend.client.search = broken
    try:
        with pytest.raises(BackendUnavailable):
            ids(backend)
    finally:
        backend.client.search = search
    assert len(calls) == 1
