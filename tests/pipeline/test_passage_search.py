"""Searches and ingests run in bounded thread pools of their own, so ingestion cannot take the
threads searches need, and torch runs in them with the thread count they are given."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import torch
from opentelemetry import trace

from pipeline.sources.search import PassageSearch
from retrieval import Document, Embedder, HybridRetriever, IndexStore, QueryBatcher
from retrieval.embeddings import FloatArray, embedding_executor

DOCS = [
    Document(id="paris", text="Paris is the capital of France, on the Seine."),
    Document(id="rome", text="Rome is the capital of Italy, on the Tiber."),
]


class GatedEmbedder(Embedder):
    """The real model, whose calls wait until the gate opens: an ingest as long as the test
    wants, and a count of how many run at once."""

    def __init__(self, model: Embedder) -> None:
        super().__init__()
        self.model = model
        self.gate = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self._count = threading.Lock()

    def embed(self, texts: list[str]) -> FloatArray:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self.gate.wait(30)
            return self.model.embed(texts)
        finally:
            with self._count:
                self.inside -= 1


def test_a_search_is_answered_while_more_ingests_wait_than_the_loop_has_threads(
    shared_embedder: Embedder, tmp_path: Path
) -> None:
    ingests = gated = GatedEmbedder(shared_embedder)
    store = IndexStore(tmp_path, ingests)
    gated.gate.set()
    store.upsert("reader", DOCS)
    gated.gate.clear()
    search = PassageSearch(
        store,
        HybridRetriever(store),
        QueryBatcher(shared_embedder),
        trace.NoOpTracer(),
        search_threads=1,
        ingest_threads=1,
    )
    # More blocked ingests than the event loop's default pool has threads: were ingests run
    # there (asyncio.to_thread), the search's thread would never come.
    default_threads = min(32, (os.cpu_count() or 1) + 4)

    async def main() -> tuple[list[str], int]:
        writes = [
            asyncio.create_task(
                search.ingest(f"writer{i}", [Document(id="d", text=f"Document number {i}.")])
            )
            for i in range(default_threads + 2)
        ]
        try:
            # The one ingest thread is inside the (closed) gate, the others queued behind it.
            for _ in range(1000):  # up to 10 s; gated.gate.wait gives up at 30
                if gated.inside:
                    break
                await asyncio.sleep(0.01)
            assert gated.inside == 1, "no ingest reached the embedder"
            found = await asyncio.wait_for(
                search.search("reader", "capital of Italy", top_k=1, embed_scope="reader"), 10
            )
            running = gated.inside
        finally:
            gated.gate.set()
            await asyncio.gather(*writes)
            await search.aclose()
        return [hit.document_id for hit in found.hits], running

    hits, running = asyncio.run(main())
    assert hits == ["rome"]
    assert running == 1  # one ingest embedding (ingest_threads=1), the others queued
    assert gated.most_inside == 1
    assert all(store.current(f"writer{i}") is not None for i in range(default_threads + 2))


def test_embedding_threads_run_torch_with_their_own_thread_count() -> None:
    for threads in (2, 1):  # 1 last: the service's default stays torch's default for new threads
        pool = embedding_executor(1, threads, "test-embed")
        try:
            assert pool.submit(torch.get_num_threads).result() == threads
        finally:
            pool.shutdown()


def test_searches_and_ingests_give_the_same_answers_from_their_own_pools(
    shared_embedder: Embedder, tmp_path: Path
) -> None:
    store = IndexStore(tmp_path, shared_embedder)
    search = PassageSearch(
        store, HybridRetriever(store), QueryBatcher(shared_embedder), trace.NoOpTracer()
    )

    async def main() -> tuple[str, str, set[str]]:
        try:
            result = await search.ingest("acme", DOCS)
            vector = await search.embed("capital of France", scope="acme")
            hits = await search.search(
                "acme", "capital of France", top_k=1, vector=vector, embed_scope="acme"
            )
            await search.delete("acme", ["rome"])
            names = {
                t.name.split("_")[0]
                for t in threading.enumerate()
                if t.name.startswith(("search", "ingest"))
            }
            return result.version, hits.hits[0].document_id, names
        finally:
            await search.aclose()

    version, best, names = asyncio.run(main())
    assert version != "0" and best == "paris"
    assert names == {"search", "ingest"}
    index = store.current("acme")
    assert index is not None and len(index) == 1
    assert np.isclose(np.linalg.norm(index.vectors[0]), 1.0, atol=1e-4)
