"""bench/milvus_bench.py's parts on a tiny corpus with hash vectors (no model): both backends
ingest and answer through the same code the benchmark times, Milvus's own hybrid search
returns documents, and the ingest-while-serving check runs with no error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.milvus_bench import (
    ONE_CHUNK,
    TENANT,
    Queries,
    TableEmbedder,
    classify,
    embedded_backend,
    filter_rows,
    hybrid_ranker,
    hybrid_search,
    ingest_while_serving,
    latency_rows,
    milvus_backend,
)
from retrieval.backends import RetrievalBackend
from retrieval.backends.milvus import MilvusBackend, connect
from retrieval.documents import Document

WORDS = ["cell", "protein", "gene", "tumor", "dose", "risk", "trial", "brain", "virus", "memory"]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    milvus = connect(str(tmp_path / "milvus.db"))
    yield milvus
    milvus.close()


def test_classify_tells_whole_missing_partial_and_mixed_listings() -> None:
    expected = {1: 3, 2: 3, 7: 2}.__getitem__
    assert classify([1, 1, 1], expected) == "whole"
    assert classify([], expected) == "missing"
    assert classify([2, 2], expected) == "partial"
    assert classify([1, 2, 2], expected) == "mixed"
    # a generation the writer made after the search began is counted as any other
    assert classify([7, 7], expected) == "whole"


def test_both_backends_and_hybrid_search_answer_on_a_tiny_corpus(
    tmp_path: Path, client: Any
) -> None:
    docs = [
        Document(id=f"d{i}", text=" ".join(WORDS[(i + k) % 10] for k in range(12)))
        for i in range(30)
    ]
    embedder = TableEmbedder()
    texts = ["cell protein", "dose risk"]
    queries = Queries(["1", "2"], texts, embedder.embed(texts), {})
    backends: dict[str, RetrievalBackend] = {
        "embedded": embedded_backend(tmp_path / "embedded", embedder),
        "milvus": milvus_backend(client, "tiny", embedder, **ONE_CHUNK),
    }
    rows = latency_rows("tiny", backends, docs, queries, batch=10, n=5)
    assert [row.split(" | ")[1] for row in rows] == ["embedded", "milvus"]
    for backend in backends.values():
        assert backend.stats(TENANT).chunks == 30
    milvus = backends["milvus"]
    assert isinstance(milvus, MilvusBackend)
    ranked = hybrid_search(milvus, texts[0], queries.vectors[0], hybrid_ranker("rrf"), 10)
    assert len(ranked) == 10 and set(ranked) <= {d.id for d in docs}
    weighted = hybrid_ranker("weighted=0.65")
    assert hybrid_search(milvus, texts[1], queries.vectors[1], weighted, 5)


def test_ingest_while_serving_answers_every_search_and_lists_documents(client: Any) -> None:
    obs, chunks = ingest_while_serving(client, documents=5, chunks=3, seconds=1.0)
    assert chunks == 3
    assert obs.errors == []
    assert obs.searches > 0 and obs.writes > 0
    listed = sum(obs.outcomes["one pymilvus query"].values())
    assert listed == obs.checks > 0


def test_filtered_searches_through_a_typed_column_rank_as_through_the_json_path(
    tmp_path: Path, client: Any
) -> None:
    docs = [
        Document(id=f"d{i}", text=" ".join(WORDS[(i + k) % 10] for k in range(12)))
        for i in range(60)
    ]
    embedder = TableEmbedder()
    texts = ["cell protein", "dose risk", "virus memory"]
    queries = Queries(["1", "2", "3"], texts, embedder.embed(texts), {})
    rows = filter_rows(client, tmp_path, docs, queries, batch=25, n=3)
    assert len(rows) == 9  # three filters, three backends
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) >= float(cells[2])
        if cells[1].startswith("milvus"):
            assert cells[4] == "3/3", row  # typed column and JSON path: the same rankings
