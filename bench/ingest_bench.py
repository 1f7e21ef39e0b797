"""Ingestion throughput and index build time on SciFact documents.

    .venv/bin/python -m bench.ingest_bench [--docs 1000] [--backend torch onnx onnx-int8]
        [--rounds 1] [--queries 200]

1. A real ingest (IndexStore.upsert with the real, uncached embedder, default 180-word passages):
   chunks/s end to end, which embedding dominates. With several ``--backend``s (embedding
   runtimes: retrieval.embeddings.Backend), each ingests the same documents into a fresh store,
   in turn, ``--rounds`` times (the order rotating each round); then the query-embedding latency
   of one short query (SciFact claims, one at a time, one thread as the service's query embedder
   runs: RAG_RETRIEVAL__QUERY_TORCH_THREADS=1), the backends alternating query by query.
   Medians, and ratios to the first backend.
2. The index build alone from ready vectors: tokenising, BM25 (term counts + CSC weights),
   metadata columns, FAISS exact and HNSW builds, snapshot write and load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.retrieval_data import load_corpus, load_queries
from retrieval.documents import Chunk, Document, chunk_document
from retrieval.embeddings import BACKENDS, Backend, Embedder, embedding_executor, make_embedder
from retrieval.filters import MetadataColumns
from retrieval.index import TenantIndex, derive
from retrieval.snapshots import read_snapshot, write_snapshot
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize
from retrieval.vectors import DenseIndex, build_approximate

BASELINE = "torch, document order (before issue 18)"


def compare_backends(
    backends: list[Backend],
    docs: list[Document],
    rounds: int,
    queries: int,
    baseline: bool = False,
) -> TenantIndex:
    """Ingest with each backend in turn, then time single-query embeddings; print the table.
    Returns the first backend's index (for the index-build part)."""
    # As `rag ingest` makes them (app.cli.backend): arena kept, ONNX Runtime's threads spinning.
    ingest: dict[Backend, Embedder] = {b: make_embedder(b, spinning=True) for b in backends}
    rates: dict[str, list[float]] = {b: [] for b in backends}
    first_index: TenantIndex | None = None
    for embedder in ingest.values():
        embedder.warm_up()
        embedder.embed(["warm up"])
    # With `baseline`, torch also ingests as before issue 18: its texts embedded in document
    # order (IndexStore(sort_for_embedding=False)), each call padding to its longest text.
    labels: list[str] = [*backends, BASELINE] if baseline and "torch" in ingest else [*backends]
    rates[BASELINE] = []
    for r in range(rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            backend: Backend = "torch" if label == BASELINE else label  # type: ignore[assignment]
            with tempfile.TemporaryDirectory() as tmp:
                store = IndexStore(Path(tmp), ingest[backend], sort_for_embedding=label != BASELINE)
                result = store.upsert("bench", docs)
                rates[label].append(result.chunks / result.seconds)
                print(
                    f"round {r + 1} {label}: {result.documents} docs -> {result.chunks} "
                    f"chunks in {result.seconds:.1f} s = {rates[label][-1]:.1f} chunks/s",
                    flush=True,
                )
                if first_index is None and backend == backends[0]:
                    first_index = store.current("bench")
                    again = store.upsert("bench", docs[:100])
                    print(f"re-ingest 100 unchanged docs: {again.seconds:.2f} s", flush=True)
    latency = query_latency(backends, queries)
    base_rate = statistics.median(rates[backends[0]])
    base_p50 = statistics.median(latency[backends[0]])
    print(
        "| backend | ingest chunks/s (median of rounds) | x first | query p50 ms | p99 ms "
        "| first / this |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for backend in backends:
        rate = statistics.median(rates[backend])
        times = sorted(latency[backend])
        p50 = statistics.median(times)
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(
            f"| {backend} | {rate:.1f} | {rate / base_rate:.2f}x | {p50:.2f} | {p99:.2f} "
            f"| {base_p50 / p50:.2f}x |"
        )
    if rates[BASELINE]:
        rate = statistics.median(rates[BASELINE])
        print(f"| {BASELINE} | {rate:.1f} | {rate / base_rate:.2f}x | | | |")
        for backend in backends:
            ratio = statistics.median(rates[backend]) / rate
            print(f"| {backend} against {BASELINE} | | {ratio:.2f}x | | | |")
    assert first_index is not None
    return first_index


def query_latency(backends: list[Backend], count: int) -> dict[Backend, list[float]]:
    """ms per single-query embed, each backend on one thread, alternating query by query."""
    texts = list(load_queries().values())[:count]
    pools = {b: embedding_executor(1, 1 if b == "torch" else 0, f"query-{b}") for b in backends}
    embedders = {b: make_embedder(b, threads=1) for b in backends}
    times: dict[Backend, list[float]] = {b: [] for b in backends}

    def timed(embedder: Embedder, text: str) -> float:
        started = time.perf_counter()
        embedder.embed([text])
        return (time.perf_counter() - started) * 1000

    for backend in backends:
        pools[backend].submit(embedders[backend].warm_up).result()
        for text in texts[:5]:
            pools[backend].submit(timed, embedders[backend], text).result()
    for text in texts:
        for backend in backends:
            times[backend].append(pools[backend].submit(timed, embedders[backend], text).result())
    for pool in pools.values():
        pool.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also ingest with torch in document order, as before issue 18 (needs torch)",
    )
    args = parser.parse_args()
    docs = load_corpus()[: args.docs]
    if args.backend:
        index = compare_backends(args.backend, docs, args.rounds, args.queries, args.baseline)
        chunks = [c for d in docs for c in chunk_document(d)]
        index_part(chunks, index)
        return
    embedder = Embedder()
    embedder.warm_up()
    embedder.embed(["warm up"])
    with tempfile.TemporaryDirectory() as tmp:
        store = IndexStore(Path(tmp), embedder)
        result = store.upsert("bench", docs)
        index = store.current("bench")
        assert index is not None
        print(
            f"| ingest {result.documents} SciFact docs -> {result.chunks} chunks (180/30 words) "
            f"| {result.seconds:.1f} s | {result.chunks / result.seconds:.1f} chunks/s, "
            f"{result.documents / result.seconds:.1f} docs/s |"
        )
        again = store.upsert("bench", docs[:100])
        print(
            f"| re-ingest 100 unchanged docs (vectors reused, nothing embedded) "
            f"| {again.seconds:.2f} s | |"
        )
        chunks = [c for d in docs for c in chunk_document(d)]
        index_part(chunks, index)


def index_part(chunks: list[Chunk], index: TenantIndex) -> None:
    """The index build alone, from the vectors `index` holds for `chunks`."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        tokens = [tokenize(c.indexed_text) for c in chunks]
        t_tok = time.perf_counter() - started
        vectors = np.asarray(index.vectors, dtype=np.float32)
        started = time.perf_counter()
        built = derive(
            None,
            "x",
            remove=set(),
            chunks=chunks,
            tokens=tokens,
            vectors=vectors,
            approximate_above=10**9,
        )
        t_bm25 = time.perf_counter() - started
        started = time.perf_counter()
        MetadataColumns(built.records.metadata)
        t_cols = time.perf_counter() - started
        started = time.perf_counter()
        DenseIndex(vectors).search(vectors[0], 10)
        t_flat = time.perf_counter() - started
        started = time.perf_counter()
        build_approximate(vectors)
        t_hnsw = time.perf_counter() - started
        started = time.perf_counter()
        write_snapshot(built, Path(tmp) / "snap")
        t_write = time.perf_counter() - started
        started = time.perf_counter()
        read_snapshot(Path(tmp) / "snap")
        t_read = time.perf_counter() - started
    n = len(chunks)
    print(f"| tokenise {n} chunks | {t_tok:.2f} s | {n / t_tok:.0f} chunks/s |")
    print(f"| build index (records, term counts, BM25 weights) | {t_bm25:.2f} s | |")
    print(f"| metadata columns | {t_cols * 1000:.1f} ms | |")
    print(f"| FAISS IndexFlatIP build | {t_flat * 1000:.1f} ms | |")
    print(f"| FAISS HNSW32,SQ8 build (used above approximate_above) | {t_hnsw:.2f} s | |")
    print(f"| snapshot write + fsync | {t_write:.2f} s | |")
    print(f"| snapshot load (BM25 rebuilt from counts) | {t_read:.2f} s | |")


if __name__ == "__main__":
    main()
