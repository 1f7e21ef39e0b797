"""Shared fixtures: one real embedding model for the whole session, a fresh store per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from retrieval.backends.milvus import MilvusBackend
from retrieval.documents import Document
from retrieval.embeddings import Embedder, FloatArray
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore
from tests.retrieval.backends_support import milvus_backend
from tests.support.servers import RedisServer


class CountingEmbedder(Embedder):
    """The real model, counting calls and texts (to prove batching and vector reuse)."""

    def __init__(self, inner: Embedder) -> None:
        super().__init__(inner.model_path, inner.batch_size)
        self._model = inner._model
        self.calls: list[int] = []
        self.texts: list[list[str]] = []

    def embed(self, texts: list[str]) -> FloatArray:
        self.calls.append(len(texts))
        self.texts.append(list(texts))
        return super().embed(texts)


@pytest.fixture(scope="session")
def embedder(shared_embedder: Embedder) -> Embedder:
    return shared_embedder


@pytest.fixture
def counting_embedder(embedder: Embedder) -> CountingEmbedder:
    return CountingEmbedder(embedder)


@pytest.fixture
def store(tmp_path: Path, embedder: Embedder) -> Iterator[IndexStore]:
    yield IndexStore(tmp_path / "indexes", embedder)


@pytest.fixture
def retriever(store: IndexStore) -> HybridRetriever:
    return HybridRetriever(store)


# A small corpus with distinct topics, so each query has one right answer.
CORPUS = [
    Document("aspirin", "Daily low-dose aspirin lowers the risk of a first heart attack in adults "
             "with cardiovascular risk factors.", "Aspirin and the heart",
             {"year": 2019, "lang": "en", "tags": ["medicine", "cardiology"],
              "peer_reviewed": True}),
    Document("statins", "Statins reduce LDL cholesterol and cut cardiovascular events in patients "
             "with high cholesterol.", "Statins", {"year": 2021, "lang": "en",
             "tags": ["medicine", "cardiology"], "peer_reviewed": True}),
    Document("insulin", "Insulin therapy controls blood glucose in people with type 1 diabetes.",
             "Insulin", {"year": 2015, "lang": "en", "tags": ["medicine", "endocrinology"]}),
    Document("python", "Python is a programming language popular for data analysis and machine "
             "learning.", "Python", {"year": 2023, "lang": "en", "tags": ["software"]}),
    Document("rust", "Rust is a systems programming language that guarantees memory safety "
             "without a garbage collector.", "Rust", {"year": 2022, "lang": "en",
             "tags": ["software"]}),
    Document("eiffel", "The Eiffel Tower in Paris was completed in 1889 for the World's Fair.",
             "Eiffel Tower", {"year": 1889, "lang": "fr", "tags": ["history", "travel"]}),
    Document("volcano", "Mount Vesuvius erupted in 79 AD and buried the Roman city of Pompeii "
             "under ash.", "Vesuvius", {"year": 79, "lang": "it", "tags": ["history"]}),
    Document("photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose "
             "and oxygen through photosynthesis.", "Photosynthesis",
             {"year": 2010, "lang": "en", "tags": ["biology"]}),
    Document("sourdough", "Sourdough bread rises with a culture of wild yeast and lactic acid "
             "bacteria instead of commercial yeast.", "Sourdough",
             {"year": 2020, "lang": "en", "tags": ["cooking"], "date": "2020-05-01"}),
    Document("marathon", "Marathon runners rely on glycogen stores and pace carefully to avoid "
             "hitting the wall near kilometre thirty.", "Marathon running",
             {"year": 2018, "lang": "en", "tags": ["sport"], "date": "2018-10-07"}),
    Document("tides", "Ocean tides are caused mainly by the gravitational pull of the Moon on "
             "the Earth's oceans.", "Tides", {"year": 2012, "lang": "en", "tags": ["physics"]}),
    Document("jazz", "Jazz originated in New Orleans, mixing blues, ragtime and brass band "
             "music.", "Jazz", {"year": 1920, "lang": "en", "tags": ["music", "history"]}),
]  # fmt: skip


@pytest.fixture(scope="session")
def loaded(tmp_path_factory: pytest.TempPathFactory, embedder: Embedder) -> IndexStore:
    """A store with CORPUS as tenant "acme"; shared by the tests that only read it."""
    store = IndexStore(tmp_path_factory.mktemp("shared") / "indexes", embedder)
    store.upsert("acme", CORPUS)
    return store


@pytest.fixture(scope="module")
def milvus(
    tmp_path_factory: pytest.TempPathFactory, embedder: Embedder, redis_server: RedisServer
) -> Iterator[MilvusBackend]:
    """A Milvus Lite backend per test module (its own database file: one process per file),
    index versions in the tests' Redis; tenants keep the tests apart (`new_tenant`)."""
    backend = milvus_backend(tmp_path_factory.mktemp("milvus"), embedder, redis_server.url)
    yield backend
    backend.close()
