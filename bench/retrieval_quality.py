"""Retrieval quality on SciFact TEST: BM25 alone, dense alone (full corpus, FAISS), the cascade.

    .venv/bin/python -m bench.retrieval_quality [--backend torch onnx onnx-int8]

Each SciFact document is indexed as one chunk (title + abstract, no splitting), through a real
IndexStore, so the numbers are those of the code the service runs. The cascade uses
HybridRetriever's defaults (tuned on train by bench.retrieval_tune). Reference rows: full-corpus
reciprocal-rank fusion (k=60) and BM25's top 100 re-ranked by the vector score alone.

``--backend`` names the embedding runtimes to compare (retrieval.embeddings.Backend): one table
each, then the change of every row's nDCG@10 from the first backend's. Each backend's vectors
are cached on disk (bench.retrieval_data.CachedEmbedder), so only a first run embeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.retrieval_data import (
    CachedEmbedder,
    Split,
    load_corpus,
    load_split,
    ndcg_at_k,
    recall_at_k,
)
from retrieval.documents import chunk_document
from retrieval.embeddings import BACKENDS, Backend
from retrieval.fusion import ranks
from retrieval.hybrid import HybridRetriever, dense_search
from retrieval.index import TenantIndex
from retrieval.onnx_embeddings import OnnxEmbedder, OpenVinoEmbedder, native_bf16
from retrieval.store import IndexStore
from retrieval.vectors import FloatArray


def evaluate(
    name: str,
    rank: Callable[[str, FloatArray], list[str]],
    ids: list[str],
    queries: dict[str, str],
    vectors: FloatArray,
    qrels: dict[str, dict[str, int]],
) -> tuple[str, float, float, float]:
    """Mean nDCG@10 and recall@100 of one ranking function, and its mean ms per query."""
    ndcg = recall = 0.0
    started = time.perf_counter()
    for q, vector in zip(ids, vectors, strict=True):
        ranked = rank(queries[q], vector)
        ndcg += ndcg_at_k(ranked, qrels[q])
        recall += recall_at_k(ranked, qrels[q])
    ms = (time.perf_counter() - started) * 1000 / len(ids)
    return name, ndcg / len(ids), recall / len(ids), ms


class CachedOnnxEmbedder(CachedEmbedder, OnnxEmbedder):
    """CachedEmbedder whose misses the ONNX embedder embeds (CachedEmbedder's ``super()``
    calls resolve to OnnxEmbedder in this order), in a cache file of its own."""

    def __init__(self, quantized: bool) -> None:
        super().__init__("minilm-onnx-int8" if quantized else "minilm-onnx", batch_size=32)
        self.quantized = quantized


class CachedOpenVinoEmbedder(CachedEmbedder, OpenVinoEmbedder):
    """CachedEmbedder whose misses OpenVINO embeds, in a cache file of its own (named by the
    precision it computes in on this CPU)."""

    def __init__(self) -> None:
        super().__init__(f"minilm-openvino-{'bf16' if native_bf16() else 'f32'}", batch_size=32)


def cached_embedder(backend: Backend) -> CachedEmbedder:
    if backend == "openvino":
        return CachedOpenVinoEmbedder()
    return CachedEmbedder() if backend == "torch" else CachedOnnxEmbedder(backend == "onnx-int8")


def load_backend_split(split: str, backend: Backend) -> Split:
    """`bench.retrieval_data.load_split` with `backend`'s vectors: the corpus is embedded in
    calls of 512 first (so a first run sorts by length over many passages), then indexed."""
    embedder = cached_embedder(backend)
    texts = [
        chunk_document(d, max_words=100_000, overlap_words=0)[0].indexed_text for d in load_corpus()
    ]
    for start in range(0, len(texts), 512):
        embedder.embed(texts[start : start + 512])
    return load_split(split, embedder)


Row = tuple[str, float, float, float]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["torch"])
    parser.add_argument(
        "--query-backend",
        choices=BACKENDS,
        default=None,
        help="embed the queries with this backend instead (passages by --backend): an index "
        "ingested by one runtime, searched by another",
    )
    args = parser.parse_args()
    tables = {backend: quality(backend, args.query_backend) for backend in args.backend}
    first, *others = args.backend
    if not others:
        return
    print(f"\nnDCG@10 change from {first}:")
    print("| ranking | " + " | ".join(f"{b} - {first}" for b in others) + " |")
    print("| --- |" + " --- |" * len(others))
    for i, (name, *_) in enumerate(tables[first]):
        deltas = [tables[b][i][1] - tables[first][i][1] for b in others]
        print(f"| {name} | " + " | ".join(f"{d:+.4f}" for d in deltas) + " |")


def quality(backend: Backend, query_backend: Backend | None = None) -> list[Row]:
    split = load_backend_split("test", backend)
    if query_backend is not None:
        asked = cached_embedder(query_backend).embed([split.queries[q] for q in split.ids])
        split = dataclasses.replace(split, vectors=asked)
    embedder, qrels, queries, ids, vectors, index = (
        split.embedder,
        split.qrels,
        split.queries,
        split.ids,
        split.vectors,
        split.index,
    )
    retriever = HybridRetriever(IndexStore(Path("/nonexistent"), embedder))
    docs = index.records.document_id

    def bm25(query: str, vector: FloatArray) -> list[str]:
        result = retriever.search_index(index, query, None, top_k=100)
        return [h.document_id for h in result.hits]

    def dense(query: str, vector: FloatArray) -> list[str]:
        return [h.document_id for h in dense_search(index, vector, top_k=100).hits]

    def cascade(query: str, vector: FloatArray) -> list[str]:
        result = retriever.search_index(index, query, vector, top_k=100)
        return [h.document_id for h in result.hits]

    def full_rrf(query: str, vector: FloatArray) -> list[str]:
        scores, _ = index.bm25.scores(_tokens(query))
        fused = 1 / (60 + ranks(scores)) + 1 / (60 + ranks(np.asarray(index.vectors @ vector)))
        return [docs[i] for i in np.argsort(-fused, kind="stable")[:100]]

    def rerank_only(query: str, vector: FloatArray) -> list[str]:
        rows = _bm25_top(index, query, 100)
        order = np.argsort(-(index.vectors[rows] @ vector), kind="stable")
        return [docs[i] for i in rows[order]]

    rows = [
        evaluate("BM25 alone", bm25, ids, queries, vectors, qrels),
        evaluate(
            "dense alone (FAISS IndexFlatIP, full corpus)", dense, ids, queries, vectors, qrels
        ),
        evaluate(
            f"cascade: BM25 top-{retriever.candidates} -> vectors -> {retriever.fusion} fusion "
            f"(w={retriever.vector_weight})",
            cascade,
            ids,
            queries,
            vectors,
            qrels,
        ),
        evaluate(
            "reference: RRF k=60 of both full rankings", full_rrf, ids, queries, vectors, qrels
        ),
        evaluate(
            "reference: BM25 top-100 by vector alone", rerank_only, ids, queries, vectors, qrels
        ),
    ]
    print(
        f"SciFact test, embeddings {backend}"
        + (f" (queries {query_backend})" if query_backend else "")
        + f": {len(ids)} queries, {len(index)} documents "
        "(one chunk each)"
    )
    print("| ranking | nDCG@10 | recall@100 | ms/query |")
    print("| --- | --- | --- | --- |")
    for name, ndcg, recall, ms in rows:
        print(f"| {name} | {ndcg:.4f} | {recall:.3f} | {ms:.2f} |", flush=True)
    return rows


def _tokens(query: str) -> list[str]:
    from retrieval.tokenize import tokenize

    return tokenize(query)


def _bm25_top(index: TenantIndex, query: str, n: int) -> np.ndarray:
    scores, matched = index.bm25.scores(_tokens(query))
    rows = np.flatnonzero(matched)
    return rows[np.argsort(-scores[rows], kind="stable")[:n]]


if __name__ == "__main__":
    main()
