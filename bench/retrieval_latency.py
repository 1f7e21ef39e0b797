"""Retrieval latency at 5k (SciFact), 100k and 1M chunks (synthetic), with and without a filter.

    .venv/bin/python -m bench.retrieval_latency [--sizes 100000,1000000] [--queries 300]

Query embedding is timed separately (batch 1, batched, and through QueryBatcher). The synthetic
corpora draw each chunk's terms from SciFact's own term distribution (unigram frequencies after
tokenisation) with SciFact's passage lengths, and random unit vectors; queries are SciFact's test
claims. The filter keeps one document group in ten (10%). rank_bm25's BM25Okapi.get_scores runs
on the same 5k corpus (and the same 100k one) as the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rank_bm25 import BM25Okapi
from scipy import sparse

from bench.retrieval_data import CachedEmbedder, load_corpus, load_qrels, load_queries
from retrieval.bm25 import stack_rows
from retrieval.documents import Document
from retrieval.embeddings import Embedder, FloatArray, QueryBatcher
from retrieval.filters import parse_filters
from retrieval.hybrid import HybridRetriever, dense_search
from retrieval.index import ChunkRecords, TenantIndex
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize

FILTER = parse_filters({"group": 3})


def rss_bytes() -> int:
    """Resident memory of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn: Callable[[int], object], n: int) -> list[float]:
    """Milliseconds of fn(i) for i in range(n)."""
    out = []
    for i in range(n):
        started = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - started) * 1000)
    return out


def row(label: str, ms: list[float]) -> str:
    p50 = statistics.median(ms)
    p99 = float(np.percentile(ms, 99))
    return f"| {label} | {p50:.2f} | {p99:.2f} | {len(ms)} |"


def search_rows(
    name: str, index: TenantIndex, queries: list[str], vectors: FloatArray, dense: bool
) -> list[str]:
    retriever = HybridRetriever(IndexStore(Path("/nonexistent"), Embedder()))
    n = len(queries)

    def q(i: int) -> str:
        return queries[i % n]

    def v(i: int) -> FloatArray:
        row_vector: FloatArray = vectors[i % n]
        return row_vector

    for i in range(20):  # warm-up: first-use builds (metadata columns, caches)
        retriever.search_index(index, q(i), v(i), filters=FILTER)
    out = [
        row(f"{name}: cascade", timed(lambda i: retriever.search_index(index, q(i), v(i)), n)),
        row(
            f"{name}: cascade, filter 10%",
            timed(lambda i: retriever.search_index(index, q(i), v(i), filters=FILTER), n),
        ),
        row(f"{name}: BM25 only", timed(lambda i: retriever.search_index(index, q(i), None), n)),
    ]
    if dense:
        dense_search(index, v(0))  # builds the FAISS index
        out.append(
            row(f"{name}: dense only (FAISS exact)", timed(lambda i: dense_search(index, v(i)), n))
        )
    stages: dict[str, list[float]] = {}
    for i in range(n):
        for key, ms in retriever.search_index(index, q(i), v(i)).timings_ms.items():
            stages.setdefault(key, []).append(ms)
    out.append(
        f"| {name}: cascade stages p50 | "
        + ", ".join(f"{k} {statistics.median(ms):.3f}" for k, ms in stages.items())
        + " | | |"
    )
    return out


def scifact_index(root: Path) -> TenantIndex:
    """SciFact, one chunk per document, with a `group` (0-9) per document for the filter."""
    docs = [Document(d.id, d.text, d.title, {"group": i % 10}) for i, d in enumerate(load_corpus())]
    store = IndexStore(root, CachedEmbedder(), chunk_words=100_000, overlap_words=0)
    store.upsert("scifact", docs)
    index = store.current("scifact")
    assert index is not None
    return index


def synthetic_index(size: int, source: TenantIndex, seed: int = 0) -> TenantIndex:
    """`size` chunks whose terms follow SciFact's unigram distribution and passage lengths."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(source.tf.sum(axis=0), dtype=np.float64).ravel()
    cdf = np.cumsum(counts / counts.sum())
    lengths = np.asarray(source.tf.sum(axis=1)).ravel()
    # SciFact abstracts are ~200 words; passages are cut at 180 words, so cap lengths there.
    lengths = np.minimum(lengths, int(np.percentile(lengths, 60)))
    parts = []
    for start in range(0, size, 100_000):
        n = min(100_000, size - start)
        lens = rng.choice(lengths, n)
        terms = np.searchsorted(cdf, rng.random(int(lens.sum())), side="right").astype(np.int32)
        terms = np.minimum(terms, len(cdf) - 1)
        rows = np.repeat(np.arange(n, dtype=np.int32), lens)
        block = sparse.csr_array(
            (np.ones(len(terms), dtype=np.int32), (rows, terms)), shape=(n, len(cdf))
        )
        parts.append(block)
    tf = stack_rows(parts, len(cdf))
    del parts
    vectors = np.empty((size, source.vectors.shape[1]), dtype=np.float32)
    for start in range(0, size, 100_000):
        noise = rng.standard_normal((min(100_000, size - start), vectors.shape[1]), np.float32)
        vectors[start : start + len(noise)] = noise / np.linalg.norm(noise, axis=1, keepdims=True)
    groups = [{"group": g} for g in range(10)]
    records = ChunkRecords(
        [f"s{i}#0" for i in range(size)],
        [f"s{i}" for i in range(size)],
        [""] * size,
        [""] * size,
        [groups[i % 10] for i in range(size)],  # type: ignore[misc]
    )
    return TenantIndex(f"synthetic-{size}", records, vectors, tf, list(source.terms))


def token_lists(index: TenantIndex, limit: int) -> list[list[str]]:
    """The first `limit` chunks as token lists (for rank_bm25)."""
    tf = index.tf
    out = []
    for r in range(min(limit, tf.shape[0])):
        start, end = tf.indptr[r], tf.indptr[r + 1]
        out.append(
            [
                index.terms[t]
                for t, c in zip(tf.indices[start:end], tf.data[start:end], strict=True)
                for _ in range(c)
            ]
        )
    return out


def rank_bm25_rows(name: str, index: TenantIndex, queries: list[str], n: int) -> list[str]:
    started = time.perf_counter()
    reference = BM25Okapi(token_lists(index, len(index)))
    built = time.perf_counter() - started
    tokens = [tokenize(q) for q in queries]
    ms = timed(lambda i: reference.get_scores(tokens[i % len(tokens)]), n)
    return [row(f"{name}: rank_bm25 BM25Okapi.get_scores (build {built:.1f} s)", ms)]


def embedding_rows(queries: list[str]) -> list[str]:
    embedder = Embedder()
    embedder.warm_up()
    embedder.embed(queries[:8])
    one = timed(lambda i: embedder.embed([queries[i]]), 64)
    started = time.perf_counter()
    for start in range(0, 128, 32):
        embedder.embed(queries[start : start + 32])
    batched = (time.perf_counter() - started) * 1000 / 128

    async def concurrent() -> float:
        batcher = QueryBatcher(embedder, max_batch=32, window_s=0.002)
        started = time.perf_counter()
        await asyncio.gather(*(batcher.embed(q, scope="bench") for q in queries[:128]))
        await batcher.aclose()
        return (time.perf_counter() - started) * 1000 / 128

    through_batcher = asyncio.run(concurrent())
    return [
        row("query embedding, batch 1 (ms per query)", one),
        f"| query embedding, batches of 32 (ms per query) | {batched:.2f} | | 128 |",
        f"| query embedding, 128 concurrent callers via QueryBatcher (ms per query) "
        f"| {through_batcher:.2f} | | 128 |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rank-bm25-100k", type=int, default=10, help="queries; 0 to skip")
    args = parser.parse_args()
    started = time.perf_counter()
    all_queries = load_queries()
    ids = sorted(load_qrels("test"), key=int)
    queries = [all_queries[q] for q in ids][: args.queries]
    vectors = CachedEmbedder().embed(queries)
    lines = ["| what | p50 ms | p99 ms | queries |", "| --- | --- | --- | --- |"]
    memory = []
    with tempfile.TemporaryDirectory() as tmp:
        before = rss_bytes()
        source = scifact_index(Path(tmp))
        memory.append(("5k SciFact", len(source), source.own_nbytes, rss_bytes() - before))
    lines += search_rows("5k SciFact", source, queries, vectors, dense=True)
    lines += rank_bm25_rows("5k SciFact", source, queries, len(queries))
    for size in (int(s) for s in args.sizes.split(",") if s):
        gc.collect()
        before = rss_bytes()
        build = time.perf_counter()
        index = synthetic_index(size, source)
        build = time.perf_counter() - build
        memory.append((f"{size // 1000}k synthetic", size, index.own_nbytes, rss_bytes() - before))
        label = f"{size // 1000}k synthetic"
        lines += search_rows(label, index, queries, vectors, dense=size <= 100_000)
        if size <= 100_000 and args.rank_bm25_100k:
            lines += rank_bm25_rows(label, index, queries, args.rank_bm25_100k)
        lines.append(f"| {label}: index built in memory in {build:.1f} s | | | |")
        del index
    lines += embedding_rows(queries)
    print("\n".join(lines))
    print()
    print("| index | chunks | array bytes/chunk | RSS growth bytes/chunk |")
    print("| --- | --- | --- | --- |")
    for name, n, nbytes, rss in memory:
        print(f"| {name} | {n} | {nbytes / n:.0f} | {rss / n:.0f} |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
