"""Fusing the BM25 and vector rankings of one candidate set.

Two families, both tuned on SciFact train (bench/retrieval_tune.py):

- "rrf": weighted reciprocal-rank fusion, `(1 - w) / (k + bm25_rank) + w / (k + vector_rank)`.
- "minmax": each score min-max normalised over the candidates, then `(1 - w) * bm25 + w * vector`.

A candidate that holds no query term (possible when a narrow filter lets every allowed chunk in)
gets no BM25 share.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]
FusionMethod = Literal["rrf", "minmax"]


def ranks(scores: FloatArray) -> npt.NDArray[np.float64]:
    """1-based rank of each score, best first (ties in input order)."""
    order = np.argsort(-scores, kind="stable")
    result = np.empty(len(scores), dtype=np.float64)
    result[order] = np.arange(1, len(scores) + 1)
    return result


def _minmax(scores: FloatArray, among: BoolArray) -> npt.NDArray[np.float64]:
    result = np.zeros(len(scores), dtype=np.float64)
    if not among.any():
        return result
    values = scores[among].astype(np.float64)
    low, high = values.min(), values.max()
    result[among] = (values - low) / (high - low) if high > low else 1.0
    return result


def fuse(
    bm25: FloatArray,
    matched: BoolArray,
    vector: FloatArray,
    *,
    method: FusionMethod,
    vector_weight: float,
    rrf_k: float,
) -> npt.NDArray[np.float64]:
    """Fused score of each candidate (higher is better)."""
    if method == "rrf":
        lexical_ranks = ranks(np.where(matched, bm25, -np.inf).astype(np.float32))
        lexical = np.where(matched, (1 - vector_weight) / (rrf_k + lexical_ranks), 0.0)
        dense = vector_weight / (rrf_k + ranks(vector))
        fused: npt.NDArray[np.float64] = lexical + dense
        return fused
    if method == "minmax":
        everyone = np.ones(len(vector), dtype=np.bool_)
        mixed: npt.NDArray[np.float64] = (1 - vector_weight) * _minmax(
            bm25, matched
        ) + vector_weight * _minmax(vector, everyone)
        return mixed
    raise ValueError(f"unknown fusion method {method!r}")
