"""Ingestion throughput and index build time on SciFact documents.

    .venv/bin/python -m bench.ingest_bench [--docs 1000]

1. A real ingest (IndexStore.upsert with the real, uncached embedder, default 180-word passages):
   chunks/s end to end, which embedding dominates.
2. The index build alone from ready vectors: tokenising, BM25 (term counts + CSC weights),
   metadata columns, FAISS exact and HNSW builds, snapshot write and load.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.retrieval_data import load_corpus
from retrieval.documents import chunk_document
from retrieval.embeddings import Embedder
from retrieval.filters import MetadataColumns
from retrieval.index import derive
from retrieval.snapshots import read_snapshot, write_snapshot
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize
from retrieval.vectors import DenseIndex, build_approximate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=1000)
    args = parser.parse_args()
    docs = load_corpus()[: args.docs]
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
