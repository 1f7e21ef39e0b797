"""The Milvus backend (Milvus Lite) against the embedded index, side by side in one run (issue 19).

    .venv/bin/python -m bench.milvus_bench [--quick] [--sizes 100000] [--queries 300]

1. Quality: SciFact test nDCG@10 through both backends' `search` (one chunk per document, title
   + abstract, the same embedder and vectors: bench.retrieval_data.CachedEmbedder), and Milvus's
   own `hybrid_search` (a BM25 request and a dense request over the backend's collection, fused
   by RRFRanker or WeightedRanker) with its p50 latency.
2. Latency: p50/p99 per query at 5k (SciFact) and the synthetic sizes
   (bench.retrieval_latency.synthetic_index: SciFact's term distribution and passage lengths,
   random unit vectors), query vectors made beforehand (embedding excluded; timed apart), and
   ingestion passages/s through each backend's `upsert` with the embedding served from a table
   made beforehand (so neither side pays for embedding).
3. Ingest while serving (Milvus): one thread upserts documents of several chunks, each write
   replacing a document with its next generation (every chunk carries `gen` in its metadata),
   while another searches; then for a hit document, a listing of its chunks (a search filtered
   to it through the backend, and one pymilvus `query`) must show one generation, complete.

The Milvus Lite database is a file in a temporary directory; index versions are counted in
memory (the backend's VersionCounter protocol) instead of Redis, as nothing here caches answers.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.retrieval_data import (
    CachedEmbedder,
    load_corpus,
    load_qrels,
    load_queries,
    ndcg_at_k,
)
from bench.retrieval_latency import synthetic_index, token_lists
from retrieval.backends import RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.milvus import MilvusBackend, connect
from retrieval.documents import Document, chunk_document
from retrieval.embeddings import DIMENSION, Embedder
from retrieval.filters import Filter, parse_filters
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore
from retrieval.vectors import FloatArray

TENANT = "bench"
ONE_CHUNK = {"chunk_words": 100_000, "overlap_words": 0}


class MemoryVersions:
    """Index versions in this process (the backend's VersionCounter; Redis in the service)."""

    def __init__(self) -> None:
        self._values: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str) -> str:
        with self._lock:
            value = self._values.get(tenant)
        return "none" if value is None else str(value)

    def bump(self, tenant: str) -> str:
        with self._lock:
            self._values[tenant] = self._values.get(tenant, 0) + 1
            return str(self._values[tenant])

    def check(self) -> None:
        """Always able to count."""


class TableEmbedder(Embedder):
    """Vectors looked up in a table made beforehand; a text not in it gets a unit vector drawn
    from its hash (deterministic), so no model is loaded and ingestion pays no embedding."""

    def __init__(self, table: dict[str, FloatArray] | None = None) -> None:
        super().__init__()
        self.table = table if table is not None else {}

    def embed(self, texts: list[str]) -> FloatArray:
        if not texts:
            return np.zeros((0, DIMENSION), dtype=np.float32)
        return np.stack([self.table.get(t, _hash_vector(t)) for t in texts]).astype(np.float32)


def _hash_vector(text: str) -> FloatArray:
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)
    out: FloatArray = v / np.linalg.norm(v)
    return out


def indexed_texts(docs: Sequence[Document]) -> list[str]:
    return [chunk_document(d, max_words=100_000, overlap_words=0)[0].indexed_text for d in docs]


def embedded_backend(root: Path, embedder: Embedder) -> EmbeddedBackend:
    store = IndexStore(root, embedder, chunk_words=100_000, overlap_words=0)
    return EmbeddedBackend(store, HybridRetriever(store))


def milvus_backend(
    client: Any, collection: str, embedder: Embedder, **options: Any
) -> MilvusBackend:
    return MilvusBackend(client, collection, embedder, MemoryVersions(), **options)


def percentiles(ms: Sequence[float]) -> tuple[float, float]:
    return statistics.median(ms), float(np.percentile(ms, 99))


def timed(fn: Callable[[int], object], n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - started) * 1000)
    return out


def ingest(backend: RetrievalBackend, docs: Sequence[Document], batch: int) -> float:
    """Passages/s of `backend.upsert` over `docs` in calls of `batch` documents."""
    started = time.perf_counter()
    for start in range(0, len(docs), batch):
        backend.upsert(TENANT, docs[start : start + batch])
    return len(docs) / (time.perf_counter() - started)


# -- 1. quality -------------------------------------------------------------------------------


@dataclass
class Queries:
    ids: list[str]
    texts: list[str]
    vectors: FloatArray
    qrels: dict[str, dict[str, int]]


def hybrid_ranker(name: str) -> Any:
    from pymilvus import RRFRanker, WeightedRanker

    if name == "rrf":
        return RRFRanker(60)
    weight = float(name.split("=")[1])  # "weighted=0.65": the dense request's weight
    return WeightedRanker(1.0 - weight, weight)


def hybrid_search(
    backend: MilvusBackend, query: str, vector: FloatArray, ranker: Any, limit: int
) -> list[str]:
    """Milvus's own hybrid search on the backend's collection: BM25 top `limit` and dense top
    `limit`, fused by `ranker` inside Milvus; document ids, best first."""
    from pymilvus import AnnSearchRequest

    expr = f'tenant == "{TENANT}"'
    reqs = [
        AnnSearchRequest([query], "sparse", {"metric_type": "BM25"}, limit, expr=expr),
        AnnSearchRequest([vector.tolist()], "dense", {"metric_type": "IP"}, limit, expr=expr),
    ]
    result = backend.client.hybrid_search(
        backend.collection, reqs, ranker, limit=limit, output_fields=["document_id"]
    )
    return [hit["entity"]["document_id"] for hit in result[0]]


def quality_rows(
    backends: dict[str, RetrievalBackend],
    milvus: MilvusBackend,
    queries: Queries,
    rankers: Sequence[str],
) -> list[str]:
    """nDCG@10 (top 100 asked, as bench.retrieval_quality) and p50/p99 ms per query."""
    rows = ["| ranking | nDCG@10 | p50 ms | p99 ms |", "| --- | --- | --- | --- |"]
    rankings: dict[str, Callable[[str, FloatArray], list[str]]] = {}
    for name, backend in backends.items():

        def through(q: str, v: FloatArray, b: RetrievalBackend = backend) -> list[str]:
            return [h.document_id for h in b.search(TENANT, q, v, top_k=100).hits]

        rankings[f"{name}: cascade (backend.search)"] = through
    for ranker_name in rankers:
        ranker = hybrid_ranker(ranker_name)

        def hybrid(q: str, v: FloatArray, r: Any = ranker) -> list[str]:
            return hybrid_search(milvus, q, v, r, 100)

        rankings[f"milvus: hybrid_search, BM25 100 + dense 100, {ranker_name}"] = hybrid
    ndcgs: dict[str, float] = {}
    for label, rank in rankings.items():
        for i in range(3):  # warm-up
            rank(queries.texts[i], queries.vectors[i])
        ndcg, ms = 0.0, []
        for q, text, vector in zip(queries.ids, queries.texts, queries.vectors, strict=True):
            started = time.perf_counter()
            ranked = rank(text, vector)
            ms.append((time.perf_counter() - started) * 1000)
            ndcg += ndcg_at_k(ranked, queries.qrels[q])
        ndcgs[label] = ndcg / len(queries.ids)
        p50, p99 = percentiles(ms)
        rows.append(f"| {label} | {ndcgs[label]:.4f} | {p50:.2f} | {p99:.2f} |")
        print(rows[-1], flush=True)
    first, second = list(ndcgs.values())[:2]
    rows.append(f"\nnDCG@10 milvus - embedded: {second - first:+.4f} (target: within 0.01)")
    return rows


# -- 2. latency and ingestion -----------------------------------------------------------------


def synthetic_documents(size: int, source: Any, seed: int = 0) -> list[Document]:
    """`size` one-chunk documents whose texts are the synthetic index's token lists (stems
    of SciFact's terms, in SciFact's unigram proportions and passage lengths)."""
    index = synthetic_index(size, source, seed)
    return [
        Document(id=f"s{i}", text=" ".join(tokens) or "empty")
        for i, tokens in enumerate(token_lists(index, size))
    ]


FILTER_SPECS: dict[str, dict[str, Any]] = {
    "year >= 2015 (~31%)": {"year": {"$gte": 2015}},
    "year in [2020, 2022) (~6%)": {"year": {"$gte": 2020, "$lt": 2022}},
    "year == 2020 (~3%, digests)": {"year": 2020},
}


def with_years(docs: Sequence[Document]) -> list[Document]:
    """`docs` with a `year` from 1990 to 2024, spread evenly and deterministically."""
    return [
        Document(id=d.id, text=d.text, metadata={"year": 1990 + (i * 7919) % 35})
        for i, d in enumerate(docs)
    ]


def filter_rows(
    client: Any, root: Path, docs: Sequence[Document], queries: Queries, batch: int, n: int
) -> list[str]:
    """Filtered searches, side by side: the embedded index, Milvus reading the JSON path, and
    Milvus reading a typed `year` column; each timed over `n` queries per filter, and each
    ranking compared with Milvus's through the JSON path (same top 5, in order: the typed
    column must give exactly the same; the embedded index differs by its own BM25)."""
    dated = with_years(docs)
    vectors = TableEmbedder()
    vectors.table = {t: _hash_vector(t) for t in indexed_texts(dated)}
    size = len(dated)
    backends: dict[str, RetrievalBackend] = {
        "embedded": embedded_backend(root / f"embedded-filters-{size}", vectors),
        "milvus, JSON path": milvus_backend(
            client, f"json{size}", vectors, typed_fields={}, **ONE_CHUNK
        ),
        "milvus, typed column": milvus_backend(
            client, f"typed{size}", vectors, typed_fields={"year": "number"}, **ONE_CHUNK
        ),
    }
    for backend in backends.values():
        ingest(backend, dated, batch)
    rows = []
    m = len(queries.texts)

    def run(i: int, b: RetrievalBackend, filters: Filter) -> list[str]:
        result = b.search(TENANT, queries.texts[i % m], queries.vectors[i % m], filters=filters)
        return [h.document_id for h in result.hits]

    for label, spec in FILTER_SPECS.items():
        f = parse_filters(spec)
        reference = [run(i, backends["milvus, JSON path"], f) for i in range(n)]
        for name, backend in backends.items():
            for i in range(3):
                run(i, backend, f)
            ms = timed(lambda i, b=backend, f=f: run(i, b, f), n)
            same = sum(run(i, backend, f) == reference[i] for i in range(n))
            p50, p99 = percentiles(ms)
            rows.append(f"| {label} | {name} | {p50:.2f} | {p99:.2f} | {same}/{n} |")
            print(rows[-1], flush=True)
    return rows


def latency_rows(
    label: str,
    backends: dict[str, RetrievalBackend],
    docs: Sequence[Document],
    queries: Queries,
    batch: int,
    n: int,
) -> list[str]:
    """Ingest `docs` into each backend (embedding from a table), then time `n` searches."""
    rows = []
    for name, backend in backends.items():
        rate = ingest(backend, docs, batch)
        for i in range(5):
            _search(backend, queries, i)
        ms = timed(partial(_search, backend, queries), n)
        p50, p99 = percentiles(ms)
        rows.append(
            f"| {label} | {name} | {len(docs)} | {p50:.2f} | {p99:.2f} | {n} | {rate:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def _search(backend: RetrievalBackend, queries: Queries, i: int) -> object:
    m = len(queries.texts)
    return backend.search(TENANT, queries.texts[i % m], queries.vectors[i % m])


# -- 3. ingest while serving ------------------------------------------------------------------


@dataclass
class Observations:
    searches: int = 0
    errors: list[str] = field(default_factory=list)
    ms_before: list[float] = field(default_factory=list)
    ms_during: list[float] = field(default_factory=list)
    writes: int = 0
    write_ms: list[float] = field(default_factory=list)
    checks: int = 0
    # what a listing of one hit document showed, per way of listing
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    mixed_in_results: int = 0

    def count(self, how: str, outcome: str) -> None:
        by = self.outcomes.setdefault(how, {})
        by[outcome] = by.get(outcome, 0) + 1


def live_document(doc: int, gen: int, chunks: int, words: int) -> Document:
    rng = random.Random(doc * 1_000_003 + gen)
    vocab = ["cell", "protein", "gene", "tumor", "dose", "risk", "trial", "brain", "virus"]
    text = " ".join(f"d{doc}g{gen}" if w == 0 else rng.choice(vocab) for w in range(chunks * words))
    return Document(
        id=f"doc{doc}", text=text, title=f"document {doc}", metadata={"gen": gen, "doc": doc}
    )


def _int(value: object) -> int:
    assert isinstance(value, int | float | str)
    return int(value)


def classify(gens: list[int], expected: Callable[[int], int]) -> str:
    """What one listing of a document's chunks shows: `whole` (one generation, all its
    chunks), `missing` (none), `mixed` (two generations), `partial` (one, not all).
    `expected(g)` is how many chunks generation g has; it is asked of the generation listed,
    which the writer may have made after the listing began."""
    if not gens:
        return "missing"
    if len(set(gens)) > 1:
        return "mixed"
    return "whole" if len(gens) == expected(gens[0]) else "partial"


def ingest_while_serving(
    client: Any, documents: int, chunks: int, seconds: float, seed: int = 0
) -> tuple[Observations, int]:
    words = 40
    backend = milvus_backend(
        client, "live", TableEmbedder(), chunk_words=words, overlap_words=0, candidates=100
    )
    gen = dict.fromkeys(range(documents), 0)

    @cache
    def expected_chunks(d: int, g: int) -> int:
        document = live_document(d, g, chunks, words)
        return len(chunk_document(document, max_words=words, overlap_words=0))

    backend.upsert(TENANT, [live_document(d, 0, chunks, words) for d in range(documents)])
    obs = Observations()
    rng = random.Random(seed)
    embedder = TableEmbedder()
    vocab = ["cell protein", "gene tumor", "dose risk", "trial brain", "virus cell"]
    stop = threading.Event()

    def writer() -> None:
        wrng = random.Random(seed + 1)
        while not stop.is_set():
            d = wrng.randrange(documents)
            g = gen[d] + 1
            started = time.perf_counter()
            try:
                backend.upsert(TENANT, [live_document(d, g, chunks, words)])
            except Exception as exc:  # counted, reported
                obs.errors.append(f"upsert: {type(exc).__name__}: {exc}")
                continue
            obs.write_ms.append((time.perf_counter() - started) * 1000)
            gen[d] = g
            obs.writes += 1

    def listing_by_query(d: int) -> list[int]:
        rows = backend._query(  # the interface has no listing; one pymilvus query
            TENANT, f'tenant == "{TENANT}" and document_id == "doc{d}"', ["metadata"], limit=1000
        )
        return [int(r["metadata"]["gen"]) for r in rows]

    def listing_by_search(d: int, query: str, vector: FloatArray) -> list[int]:
        hits = backend.search(
            TENANT, query, vector, top_k=1000, filters=parse_filters({"doc": d})
        ).hits
        return [_int(h.metadata["gen"]) for h in hits]

    def one_search(ms: list[float]) -> None:
        query = rng.choice(vocab)
        vector = embedder.embed([query])[0]
        started = time.perf_counter()
        try:
            hits = backend.search(TENANT, query, vector, top_k=10).hits
        except Exception as exc:  # counted, reported
            obs.errors.append(f"search: {type(exc).__name__}: {exc}")
            return
        ms.append((time.perf_counter() - started) * 1000)
        obs.searches += 1
        by_doc: dict[str, set[int]] = {}
        for h in hits:
            by_doc.setdefault(h.document_id, set()).add(_int(h.metadata["gen"]))
        obs.mixed_in_results += sum(1 for g in by_doc.values() if len(g) > 1)
        if not hits:
            return
        d = _int(hits[0].metadata["doc"])
        expected = partial(expected_chunks, d)
        try:
            obs.count(
                "search filtered to the document",
                classify(listing_by_search(d, query, vector), expected),
            )
            obs.count("one pymilvus query", classify(listing_by_query(d), expected))
        except Exception as exc:  # counted, reported
            obs.errors.append(f"listing: {type(exc).__name__}: {exc}")
            return
        obs.checks += 1

    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        one_search(obs.ms_before)
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        one_search(obs.ms_during)
    stop.set()
    thread.join(timeout=60)
    return obs, expected_chunks(0, 0)


def serving_rows(obs: Observations, documents: int, chunks: int, seconds: float) -> list[str]:
    rows = []
    b50, b99 = percentiles(obs.ms_before) if obs.ms_before else (0.0, 0.0)
    d50, d99 = percentiles(obs.ms_during) if obs.ms_during else (0.0, 0.0)
    w50 = statistics.median(obs.write_ms) if obs.write_ms else 0.0
    rows.append(
        f"{documents} documents of {chunks} chunks; {seconds:.0f} s searching alone, then "
        f"{seconds:.0f} s with a writer replacing one document per upsert"
    )
    rows.append("| phase | searches | p50 ms | p99 ms |")
    rows.append("| --- | --- | --- | --- |")
    rows.append(f"| before (no writer) | {len(obs.ms_before)} | {b50:.2f} | {b99:.2f} |")
    rows.append(f"| during (writer running) | {len(obs.ms_during)} | {d50:.2f} | {d99:.2f} |")
    rows.append(
        f"\nsearches answered {obs.searches}, errors {len(obs.errors)}; upserts {obs.writes} "
        f"(p50 {w50:.1f} ms); documents with two generations inside one result: "
        f"{obs.mixed_in_results}"
    )
    rows.append("\n| listing of the top hit's document | whole | missing | partial | mixed |")
    rows.append("| --- | --- | --- | --- | --- |")
    for how, by in obs.outcomes.items():
        rows.append(
            f"| {how} | {by.get('whole', 0)} | {by.get('missing', 0)} | "
            f"{by.get('partial', 0)} | {by.get('mixed', 0)} |"
        )
    for error in obs.errors[:5]:
        rows.append(f"error: {error}")
    return rows


# -- the run ----------------------------------------------------------------------------------


def scifact_queries(limit: int, embedder: Embedder) -> Queries:
    qrels = load_qrels("test")
    texts = load_queries()
    ids = sorted(qrels, key=int)[:limit]
    started = time.perf_counter()
    vectors = embedder.embed([texts[q] for q in ids])
    print(f"query vectors: {len(ids)} in {time.perf_counter() - started:.1f} s", flush=True)
    return Queries(ids, [texts[q] for q in ids], vectors, qrels)


def query_embedding_row(queries: Queries) -> str:
    """Query embedding, batch 1, timed apart (bench.retrieval_latency does the same)."""
    embedder = Embedder()
    embedder.warm_up()
    embedder.embed(queries.texts[:4])
    ms = timed(lambda i: embedder.embed([queries.texts[i % len(queries.texts)]]), 32)
    p50, p99 = percentiles(ms)
    return f"query embedding, batch 1 (not in the figures above): p50 {p50:.2f} ms, p99 {p99:.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes, a few queries")
    parser.add_argument("--queries", type=int, default=300, help="SciFact test queries")
    parser.add_argument("--sizes", default="100000", help="synthetic corpus sizes")
    parser.add_argument("--latency-queries", type=int, default=300)
    parser.add_argument("--batch", type=int, default=5000, help="documents per upsert call")
    parser.add_argument("--rankers", default="rrf,weighted=0.65,weighted=0.5")
    parser.add_argument("--live-documents", type=int, default=200)
    parser.add_argument("--live-chunks", type=int, default=4)
    parser.add_argument("--live-seconds", type=float, default=30.0)
    parser.add_argument("--skip", default="", help="comma-separated: quality,latency,filters,live")
    parser.add_argument(
        "--filter-size", type=int, default=100_000, help="filtered searches' corpus"
    )
    parser.add_argument(
        "--hash-embeddings",
        action="store_true",
        help="hash vectors instead of MiniLM (a smoke run: quality figures are meaningless)",
    )
    args = parser.parse_args(argv)
    # Milvus Lite answers an empty query with an error the backend reads as "no rows"; pymilvus
    # logs each one.
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    if args.quick:
        args.queries, args.sizes, args.latency_queries = 30, "3000", 30
        args.live_documents, args.live_seconds, args.filter_size = 50, 5.0, 3000
    skip = set(args.skip.split(","))
    started = time.perf_counter()
    out: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        client = connect(str(root / "milvus.db"))
        cached: Embedder = TableEmbedder() if args.hash_embeddings else CachedEmbedder()
        queries = scifact_queries(args.queries, cached)
        corpus = load_corpus()
        if args.quick:  # the queries' relevant documents and 500 others
            wanted = {d for q in queries.ids for d in queries.qrels[q]}
            corpus = [d for i, d in enumerate(corpus) if i < 500 or d.id in wanted]
        # Embedding from the on-disk cache for both (made first, outside the timings).
        texts = indexed_texts(corpus)
        table = dict(zip(texts, cached.embed(texts), strict=True))
        scifact: dict[str, RetrievalBackend] = {
            "embedded": embedded_backend(root / "embedded-5k", TableEmbedder(table)),
            "milvus": milvus_backend(client, "scifact", TableEmbedder(table), **ONE_CHUNK),
        }
        out.append(
            f"## latency (ms per query, embedding excluded) and ingestion, {os.cpu_count()} CPUs"
        )
        out.append("| corpus | backend | chunks | p50 ms | p99 ms | queries | ingest passages/s |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        out += latency_rows(
            f"SciFact {len(corpus)}", scifact, corpus, queries, args.batch, args.latency_queries
        )
        if "quality" not in skip:
            milvus = scifact["milvus"]
            assert isinstance(milvus, MilvusBackend)
            rows = quality_rows(scifact, milvus, queries, args.rankers.split(","))
            out = [
                f"## quality: SciFact test, {len(queries.ids)} queries, {len(corpus)} docs",
                *rows,
                "",
                *out,
            ]
        if "latency" not in skip:
            embedded = scifact["embedded"]
            assert isinstance(embedded, EmbeddedBackend)
            source = embedded.store.current(TENANT)
            for size in (int(s) for s in args.sizes.split(",") if s):
                docs = synthetic_documents(size, source)
                vectors = TableEmbedder()  # hash vectors, made now so ingestion only looks up
                vectors.table = {t: _hash_vector(t) for t in indexed_texts(docs)}
                backends: dict[str, RetrievalBackend] = {
                    "embedded": embedded_backend(root / f"embedded-{size}", vectors),
                    "milvus": milvus_backend(client, f"synthetic{size}", vectors, **ONE_CHUNK),
                }
                out += latency_rows(
                    f"synthetic {size // 1000}k",
                    backends,
                    docs,
                    queries,
                    args.batch,
                    args.latency_queries,
                )
        if "filters" not in skip:
            embedded = scifact["embedded"]
            assert isinstance(embedded, EmbeddedBackend)
            docs = synthetic_documents(args.filter_size, embedded.store.current(TENANT))
            out += [
                "",
                f"## filtered searches, synthetic {args.filter_size // 1000}k (top 5)",
                "| filter | backend | p50 ms | p99 ms | same top 5 as the JSON path |",
                "| --- | --- | --- | --- | --- |",
                *filter_rows(client, root, docs, queries, args.batch, args.latency_queries),
            ]
        if not args.hash_embeddings:
            out.append(query_embedding_row(queries))
        if "live" not in skip:
            obs, chunks = ingest_while_serving(
                client, args.live_documents, args.live_chunks, args.live_seconds
            )
            rows = serving_rows(obs, args.live_documents, chunks, args.live_seconds)
            print("\n".join(rows), flush=True)
            out += ["", "## ingest while serving (milvus)", *rows]
        client.close()
    out.append(f"\ntotal {time.perf_counter() - started:.0f} s, {os.cpu_count()} CPUs")
    print("\n".join(out))


if __name__ == "__main__":
    main()
