"""A tenant's search never reaches another tenant's documents, on the BM25 or the vector side."""

from __future__ import annotations

from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore

from .conftest import CORPUS

SECRET = Document("b-secret", "Project Nightingale merger terms: Acme buys Globex for 3 billion.")
DECOY = Document("a-merger", "A merger of two bakeries created the largest sourdough chain.")


def test_tenant_a_never_retrieves_tenant_b_documents(store: IndexStore, embedder: Embedder) -> None:
    store.upsert("tenant-a", [*CORPUS, DECOY])
    store.upsert("tenant-b", [SECRET])
    retriever = HybridRetriever(store)
    # An exact match, lexically and semantically, for B's document; "merger" also appears in A.
    query = SECRET.text
    vector = embedder.embed([query])[0]

    b = retriever.search("tenant-b", query, vector)
    assert b.hits[0].document_id == "b-secret"

    for result in (
        retriever.search("tenant-a", query, vector, top_k=100),
        retriever.search("tenant-a", query, None, top_k=100),
        retriever.search_dense("tenant-a", vector, top_k=100),
    ):
        assert result.hits, "A's own documents are still returned"
        assert {h.document_id for h in result.hits} <= {d.id for d in [*CORPUS, DECOY]}
        assert result.allowed == len(CORPUS) + 1


def test_tenants_have_their_own_statistics_and_versions(store: IndexStore) -> None:
    store.upsert("tenant-a", CORPUS)
    before = store.version("tenant-a")
    store.upsert("tenant-b", [SECRET])
    a, b = store.current("tenant-a"), store.current("tenant-b")
    assert a is not None and b is not None
    assert store.version("tenant-a") == before
    assert len(a) == len(CORPUS) and len(b) == 1
    assert "nightingal" not in a.bm25.vocab and "nightingal" in b.bm25.vocab
    assert not any(p.name.startswith("tenant-b") for p in (store.root / "tenant-a").iterdir())


def test_unknown_tenant_has_no_index_and_finds_nothing(
    loaded: IndexStore, embedder: Embedder
) -> None:
    retriever = HybridRetriever(loaded)
    result = retriever.search("nobody", "aspirin", embedder.embed(["aspirin"])[0])
    assert result.hits == [] and loaded.version("nobody") == "0"
