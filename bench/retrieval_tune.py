"""Choose the cascade's candidate count and fusion on SciFact TRAIN (never test).

    .venv/bin/python -m bench.retrieval_tune

For every train query the BM25 scores and vectors are computed once; each setting then selects
candidates and fuses them with the same functions HybridRetriever uses.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from bench.retrieval_data import load_split, ndcg_at_k
from retrieval.fusion import fuse
from retrieval.hybrid import select_candidates, top_positions
from retrieval.tokenize import tokenize

CANDIDATES = (25, 50, 100, 200, 300, 500, 1000)
RRF_K = (5, 10, 20, 40, 60, 100)
RRF_WEIGHTS = (0.3, 0.4, 0.5, 0.6, 0.7)
TOLERANCE = 0.002
MINMAX_WEIGHTS = tuple(round(float(w), 2) for w in np.arange(0.1, 0.91, 0.05))


def settings() -> list[dict[str, Any]]:
    """Every fusion setting tried."""
    rrf = [
        {"fusion": "rrf", "rrf_k": k, "vector_weight": w}
        for k, w in itertools.product(RRF_K, RRF_WEIGHTS)
    ]
    minmax = [{"fusion": "minmax", "rrf_k": 60.0, "vector_weight": w} for w in MINMAX_WEIGHTS]
    return rrf + minmax


def main() -> None:
    started = time.perf_counter()
    split = load_split("train")
    qrels, queries, ids, vectors, index = (
        split.qrels,
        split.queries,
        split.ids,
        split.vectors,
        split.index,
    )
    doc_ids = np.array(index.records.document_id)
    prepared = [index.bm25.scores(tokenize(queries[q])) for q in ids]
    results: list[tuple[float, int, dict[str, Any]]] = []
    for n in CANDIDATES:
        per_query = []
        for (scores, matched), qv in zip(prepared, vectors, strict=True):
            rows = select_candidates(scores, matched, None, len(index), n, by_vector=True)
            per_query.append((rows, scores[rows], matched[rows], index.vectors[rows] @ qv))
        for setting in settings():
            total = 0.0
            for q, (rows, bm25, is_match, vec) in zip(ids, per_query, strict=True):
                fused = fuse(
                    bm25,
                    is_match,
                    vec,
                    method=setting["fusion"],
                    vector_weight=setting["vector_weight"],
                    rrf_k=setting["rrf_k"],
                )
                best = rows[top_positions(fused, 10, rows)]
                total += ndcg_at_k(doc_ids[best].tolist(), qrels[q])
            results.append((total / len(ids), n, setting))
    results.sort(key=lambda r: -r[0])
    print(f"SciFact train: {len(ids)} queries, {len(results)} settings")
    print("best 15 (nDCG@10, candidates, fusion):")
    for score, n, setting in results[:15]:
        print(f"  {score:.4f}  N={n:<5} {setting}")
    for n in CANDIDATES:
        top = max((r for r in results if r[1] == n), key=lambda r: r[0])
        print(f"  best at N={n:<5} {top[0]:.4f} {top[2]}")
    for method in ("rrf", "minmax"):
        top = max((r for r in results if r[2]["fusion"] == method), key=lambda r: r[0])
        print(f"  best {method:<6} {top[0]:.4f} N={top[1]} {top[2]}")
    chosen = choose(results)
    print(f"chosen: {chosen}")
    print(f"took {time.perf_counter() - started:.1f} s")


def choose(results: list[tuple[float, int, dict[str, Any]]]) -> dict[str, Any]:
    """Smooth each setting's nDCG with its neighbours (weight +-0.05 for minmax, +-0.1 for rrf,
    same N and k): a plateau generalises better than a lone peak. Then take the fewest candidates
    within TOLERANCE of the best smoothed score (fewer candidates, less vector work)."""
    table = {(n, s["fusion"], s["rrf_k"], s["vector_weight"]): score for score, n, s in results}
    smoothed: list[tuple[float, dict[str, Any]]] = []
    for n, fusion, k, w in table:
        step = 0.05 if fusion == "minmax" else 0.1
        near = [table.get((n, fusion, k, round(w + d, 2))) for d in (-step, 0.0, step)]
        values = [v for v in near if v is not None]
        if len(values) == 3:
            setting = {"candidates": n, "fusion": fusion, "rrf_k": k, "vector_weight": w}
            smoothed.append((sum(values) / 3, setting))
    top = max(score for score, _ in smoothed)
    close = [(s["candidates"], -score, s) for score, s in smoothed if score >= top - TOLERANCE]
    n, neg, setting = min(close, key=lambda c: (c[0], c[1]))
    return {**setting, "smoothed_ndcg10": round(-neg, 4), "best_smoothed_ndcg10": round(top, 4)}


if __name__ == "__main__":
    main()
