"""SciFact loading, BEIR-style metrics and an on-disk embedding cache, shared by the benchmarks.

The cache lives under ~/.cache/rag/ (never in the repository): embedding the 5,183 SciFact
abstracts takes about four minutes on two cores, so it is done once.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.documents import Document
from retrieval.embeddings import Embedder, FloatArray
from retrieval.index import TenantIndex
from retrieval.store import IndexStore
from tests.support.data import SCIFACT, open_scifact

CACHE_DIR = Path.home() / ".cache" / "rag"


def load_corpus(root: Path = SCIFACT) -> list[Document]:
    """SciFact's abstracts as one `Document` each (title kept apart from the text)."""
    docs = []
    with open_scifact("corpus.jsonl", root) as f:
        for line in f:
            row = json.loads(line)
            docs.append(
                Document(id=row["_id"], text=row["text"] or row["title"], title=row["title"])
            )
    return docs


def load_queries(root: Path = SCIFACT) -> dict[str, str]:
    """Query id -> claim text."""
    with open_scifact("queries.jsonl", root) as f:
        return {row["_id"]: row["text"] for row in map(json.loads, f)}


def load_qrels(split: str, root: Path = SCIFACT) -> dict[str, dict[str, int]]:
    """Query id -> {corpus id: relevance} for `split` ("train" or "test")."""
    qrels: dict[str, dict[str, int]] = {}
    with open_scifact(f"qrels/{split}.tsv", root) as f:
        next(f)
        for line in f:
            qid, did, score = line.split()
            qrels.setdefault(qid, {})[did] = int(score)
    return qrels


def ndcg_at_k(ranked: list[str], relevant: dict[str, int], k: int = 10) -> float:
    """nDCG@k as BEIR computes it with pytrec_eval: gain = graded relevance, log2 discount."""
    dcg = sum(relevant.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((r for r in relevant.values() if r > 0), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at_k(ranked: list[str], relevant: dict[str, int], k: int = 100) -> float:
    """Share of the relevant documents found in the first k."""
    wanted = {d for d, r in relevant.items() if r > 0}
    return len(wanted.intersection(ranked[:k])) / len(wanted) if wanted else 0.0


class CachedEmbedder(Embedder):
    """An `Embedder` that remembers every vector it made, keyed by the text's SHA-256, on disk."""

    def __init__(self, name: str = "minilm", batch_size: int = 32) -> None:
        super().__init__(batch_size=batch_size)
        self.path = CACHE_DIR / f"embeddings-{name}.npz"
        self._cache: dict[str, FloatArray] = {}
        self.misses = 0
        if self.path.exists():
            data = np.load(self.path)
            self._cache = dict(zip(data["keys"].tolist(), data["vectors"], strict=True))

    def embed(self, texts: list[str]) -> FloatArray:
        keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        missing = sorted(
            {k: t for k, t in zip(keys, texts, strict=True) if k not in self._cache}.items()
        )
        if missing:
            self.misses += len(missing)
            vectors = super().embed([t for _, t in missing])
            self._cache.update(zip([k for k, _ in missing], vectors, strict=True))
            self.save()
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.stack([self._cache[k] for k in keys]).astype(np.float32)

    def save(self) -> None:
        """Write the cache atomically."""
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp.npz")
        keys = list(self._cache)
        np.savez(tmp, keys=np.array(keys), vectors=np.stack([self._cache[k] for k in keys]))
        tmp.replace(self.path)


def build_scifact_index(root: Path, embedder: Embedder) -> TenantIndex:
    """SciFact as one chunk per document (title + abstract) in a real IndexStore."""
    store = IndexStore(root, embedder, chunk_words=100_000, overlap_words=0)
    store.upsert("scifact", load_corpus())
    index = store.current("scifact")
    assert index is not None
    return index


@dataclass
class Split:
    """One qrels split, ready to rank: its queries embedded, the corpus indexed."""

    embedder: CachedEmbedder
    qrels: dict[str, dict[str, int]]
    queries: dict[str, str]
    ids: list[str]
    vectors: FloatArray
    index: TenantIndex


def load_split(split: str, embedder: CachedEmbedder | None = None) -> Split:
    embedder = CachedEmbedder() if embedder is None else embedder
    qrels = load_qrels(split)
    queries = load_queries()
    ids = sorted(qrels, key=int)
    vectors = embedder.embed([queries[q] for q in ids])
    with tempfile.TemporaryDirectory() as tmp:
        index = build_scifact_index(Path(tmp), embedder)
    return Split(embedder, qrels, queries, ids, vectors, index)


def warm_cache() -> None:
    """Embed the SciFact corpus (as the index embeds it) and all queries into the cache."""
    from retrieval.documents import chunk_document

    embedder = CachedEmbedder()
    texts = [
        chunk_document(d, max_words=100_000, overlap_words=0)[0].indexed_text for d in load_corpus()
    ]
    for start in range(0, len(texts), 512):
        embedder.embed(texts[start : start + 512])
        print(f"corpus {start + 512}/{len(texts)}", flush=True)
    embedder.embed(list(load_queries().values()))
    print("done", embedder.misses, "embedded", flush=True)


if __name__ == "__main__":
    warm_cache()
