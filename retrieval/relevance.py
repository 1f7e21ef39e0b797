"""The relevance gate: is a retrieved passage about the query at all?

Fused scores cannot say: min-max fusion puts the best candidate near 1.0 for any query, the
capital of France included. The gate reads two raw signals that are comparable across queries
instead, both on each `Hit`:

- `bm25_norm`: the passage's BM25 score divided by the highest score the query could reach
  (`BM25Index.max_score`: the sum over the query's terms of `max(idf, 0) * (k1 + 1)`, query
  words the index lacks counted at the IDF of an unseen term), so it lies in [0, 1];
- `vector_score`: the cosine of the query and passage vectors (both unit length).

A logistic model over both turns them into `relevance`, a probability-like score in (0, 1);
passages below a threshold are dropped, and when none is left the request runs without
sources. Coefficients and threshold come from `python -m bench.relevance_tune` (SciFact train
relevant pairs against hand-written off-topic questions); tuning gave BM25 a weight of 0 (see
DEFAULT_MODEL), and the model keeps both inputs so that another corpus can be tuned to use it.
BENCHMARKS.md has how the gate does on SciFact test and on held-out off-topic questions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class RelevanceModel:
    """`relevance = sigmoid(intercept + bm25_weight * bm25_norm + cosine_weight * cosine)`."""

    intercept: float
    bm25_weight: float
    cosine_weight: float

    def score(self, bm25_norm: float, cosine: float) -> float:
        """Relevance of one passage, in (0, 1)."""
        z = self.intercept + self.bm25_weight * bm25_norm + self.cosine_weight * cosine
        # Written this way round so that neither branch can overflow exp().
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)

    def scores(self, bm25_norm: FloatArray, cosine: FloatArray) -> FloatArray:
        """Relevance of many passages at once."""
        z = self.intercept + self.bm25_weight * bm25_norm + self.cosine_weight * cosine
        result: FloatArray = 0.5 * (1.0 + np.tanh(0.5 * z))
        return result


# From `.venv/bin/python -m bench.relevance_tune` (SciFact train: 646 queries with a relevant
# document in their top 4; 107 off-topic tuning questions). Every mix of the two signals was
# tried (score = sin(a) * bm25_norm + cos(a) * cosine, a = 0..90 degrees, threshold set so 97%
# of train queries keep all their relevant documents): the share of off-topic questions left
# without sources falls as BM25 weighs in (0.98 at a = 0, 0.95 at 20, 0.86 at 50, 0.24 for BM25
# alone), so the shipped model is the cosine alone, calibrated by a logistic fit; normalising
# BM25 without the unseen query words was worse still. The threshold is a cosine of 0.356.
DEFAULT_MODEL = RelevanceModel(intercept=-4.3145, bm25_weight=0.0, cosine_weight=11.8805)
DEFAULT_THRESHOLD = 0.4785


def normalised_bm25(score: float | None, max_score: float) -> float:
    """`score / max_score` clipped to [0, 1] (`max_score` from `BM25Index.max_score`).

    0 for a passage holding no query term (`score` None) and for a query no passage can score
    on (`max_score` 0: no query word with a positive IDF, as in an index of one passage, where
    every IDF is negative); a negative score (terms with negative IDF) is clipped to 0.
    """
    if score is None or max_score <= 0.0:
        return 0.0
    return min(1.0, max(0.0, score / max_score))


class Scored(Protocol):
    """Anything carrying a relevance score (a `Hit`); None means it could not be scored."""

    @property
    def relevance(self) -> float | None: ...


H = TypeVar("H", bound=Scored)


class GateResult(NamedTuple, Generic[H]):
    """The hits at or above the threshold and those below it, each in the order given."""

    kept: list[H]
    dropped: list[H]


def gate(hits: Sequence[H], threshold: float) -> GateResult[H]:
    """Split hits by `relevance >= threshold`. Unscored hits (`relevance` None: a BM25-only or
    dense-only search, where one signal is missing) are kept: the gate cannot judge them."""
    kept: list[H] = []
    dropped: list[H] = []
    for hit in hits:
        if hit.relevance is None or hit.relevance >= threshold:
            kept.append(hit)
        else:
            dropped.append(hit)
    return GateResult(kept, dropped)


class RelevanceGate:
    """The gate as a request path uses it: a configured threshold, overridable per request.

    `threshold` 0 (or `enabled=False`) keeps everything.
    """

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, *, enabled: bool = True) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError("threshold must be within [0, 1]")
        self.threshold = threshold
        self.enabled = enabled

    @classmethod
    def configured(cls, threshold: float) -> RelevanceGate:
        """The gate a server configured with `threshold` runs: switched off at 0, where a
        request's own threshold changes nothing either."""
        return cls(threshold, enabled=threshold > 0)

    def apply(self, hits: Sequence[H], threshold: float | None = None) -> GateResult[H]:
        """Gate `hits` at the request's `threshold`, or the configured one when None."""
        if not self.enabled:
            return GateResult(list(hits), [])
        return gate(hits, self.threshold if threshold is None else threshold)


def fit_logistic(
    features: FloatArray,
    labels: npt.NDArray[np.bool_],
    *,
    l2: float = 1e-3,
    iterations: int = 50,
) -> RelevanceModel:
    """Fit `RelevanceModel` on (n, 2) features [bm25_norm, cosine] by Newton's method (IRLS),
    each class weighted to half the total so the larger set does not set the intercept."""
    x = np.column_stack([np.ones(len(features)), features.astype(np.float64)])
    y = labels.astype(np.float64)
    positives = max(1.0, float(y.sum()))
    negatives = max(1.0, float(len(y) - y.sum()))
    weight = np.where(labels, 0.5 / positives, 0.5 / negatives)
    beta = np.zeros(3)
    ridge = l2 * np.diag([0.0, 1.0, 1.0])
    for _ in range(iterations):
        p = 0.5 * (1.0 + np.tanh(0.5 * (x @ beta)))
        gradient = x.T @ (weight * (p - y)) + ridge @ beta
        hessian = (x * (weight * p * (1 - p))[:, None]).T @ x + ridge
        step = np.linalg.solve(hessian, gradient)
        beta -= step
        if float(np.abs(step).max()) < 1e-10:
            break
    return RelevanceModel(float(beta[0]), float(beta[1]), float(beta[2]))
