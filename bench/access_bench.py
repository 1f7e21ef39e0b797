"""What access lists cost a search, on SciFact (5,183 abstracts, the 300 test claims).

    .venv/bin/python -m bench.access_bench [--queries 300]

Half the documents get an access list naming one of ten groups (the other half stay
tenant-wide). Timed per query, hybrid search (BM25 candidates, vectors, fusion; the query
vectors precomputed): the index without any list; the restricted index for a viewer in every
group (it sees everything, so the snapshot itself is searched); for a viewer in one group (a
cached view of the 55% it sees); and the one-off cost of building a view (once per snapshot and
distinct visible set). nDCG@10 is reported for each, to show that the lists change what is found
only by what they hide. Vectors come from the embedding cache (bench.retrieval_data).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

from bench.retrieval_data import load_split, ndcg_at_k
from retrieval.access import AccessList, Viewer
from retrieval.hybrid import HybridRetriever
from retrieval.index import ChunkRecords, TenantIndex

GROUPS = [f"g{i}" for i in range(10)]


def restricted_copy(index: TenantIndex) -> TenantIndex:
    """The same snapshot with half its documents restricted to one group each."""
    lists = {g: AccessList(groups=frozenset({g})) for g in GROUPS}
    access = []
    for doc in index.records.document_id:
        bucket = zlib.crc32(doc.encode()) % 20
        access.append(lists[GROUPS[bucket]] if bucket < 10 else None)
    r = index.records
    records = ChunkRecords(r.chunk_id, r.document_id, r.text, r.title, r.metadata, access)
    return TenantIndex(index.version, records, index.vectors, index.tf, index.terms)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    split = load_split("test")
    ids = split.ids[: args.queries]
    plain = split.index
    restricted = restricted_copy(plain)
    retriever = HybridRetriever(store=None)  # type: ignore[arg-type]  # search_index only
    everyone = Viewer("u", frozenset(GROUPS))
    one = Viewer("u", frozenset({"g3"}))
    restricted.visible_to(one)  # built once here; its cost is timed below on fresh snapshots

    cases = [
        ("no access lists (baseline)", plain, None),
        ("lists, viewer in every group (whole snapshot)", restricted, everyone),
        ("lists, viewer in one group (cached view, 55% visible)", restricted, one),
    ]
    print(f"SciFact test, {len(ids)} queries, {len(plain)} chunks; hybrid search, top 10\n")
    print("| search | p50 ms | mean ms | nDCG@10 |")
    print("| --- | --- | --- | --- |")
    for label, index, viewer in cases:
        ms, scores = [], []
        for n, qid in enumerate(ids):
            query, vector = split.queries[qid], split.vectors[n]
            started = time.perf_counter()
            result = retriever.search_index(index, query, vector, top_k=10, viewer=viewer)
            ms.append((time.perf_counter() - started) * 1000)
            scores.append(ndcg_at_k([h.document_id for h in result.hits], split.qrels[qid]))
        print(
            f"| {label} | {statistics.median(ms):.2f} | {statistics.fmean(ms):.2f} | "
            f"{statistics.fmean(scores):.3f} |"
        )
    builds = []
    for group in GROUPS:
        fresh = restricted_copy(plain)
        started = time.perf_counter()
        view = fresh.visible_to(Viewer("u", frozenset({group})))
        builds.append((time.perf_counter() - started) * 1000)
    print(
        f"\nbuilding a view (first search of a visible set on a snapshot): "
        f"p50 {statistics.median(builds):.1f} ms, max {max(builds):.1f} ms over {len(builds)}; "
        f"a view of {len(view)} chunks holds {view.resident_bytes / 2**20:.1f} MiB "
        f"(the snapshot {plain.resident_bytes / 2**20:.1f} MiB)"
    )
    # Viewers of different visible sets in turn on one snapshot: past what the views kept
    # allow (MAX_VIEWS and VIEW_BUDGET), a search rebuilds its view.
    for viewers in (2, 3, len(GROUPS)):
        shared, turns = restricted_copy(plain), []
        for n, qid in enumerate(ids[:100]):
            viewer = Viewer("u", frozenset({GROUPS[n % viewers]}))
            started = time.perf_counter()
            retriever.search_index(shared, split.queries[qid], split.vectors[n], viewer=viewer)
            turns.append((time.perf_counter() - started) * 1000)
        own = shared._own_bytes()
        print(
            f"{viewers} viewers in turn, {len(turns)} searches: p50 "
            f"{statistics.median(turns):.2f} ms, mean {statistics.fmean(turns):.2f} ms; the "
            f"snapshot counts {shared.resident_bytes / 2**20:.1f} MiB with its kept views "
            f"(itself {own / 2**20:.1f} MiB, views held {len(shared._views)})"
        )


if __name__ == "__main__":
    main()
