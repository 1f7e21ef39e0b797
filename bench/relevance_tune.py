"""Tune the relevance gate (retrieval/relevance.py) on SciFact train and off-topic questions.

Positives: the (query, document) pairs of SciFact **train** whose relevant document is among the
top_k results. Negatives: every top_k result of the tuning part of
bench/data/offtopic_questions.txt. For each variant of the features (the normalised BM25 with or
without unseen query words counted, the cosine, both) a logistic regression is fitted with
numpy; the threshold is the highest at which at least `--keep-target` of the train queries keep
all their retrieved relevant documents, and the variant that then rejects the most off-topic
questions wins. Prints the constants to paste into retrieval/relevance.py.

    .venv/bin/python -m bench.relevance_tune            # a few minutes with embeddings cached
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.retrieval_data import CachedEmbedder, Split, load_split
from retrieval.embeddings import Embedder
from retrieval.hybrid import Hit, HybridRetriever
from retrieval.index import TenantIndex
from retrieval.relevance import RelevanceModel, fit_logistic, normalised_bm25
from retrieval.store import IndexStore
from retrieval.tokenize import tokenize

OFFTOPIC = Path(__file__).parent / "data" / "offtopic_questions.txt"
FloatArray = npt.NDArray[np.float64]


def offtopic_questions(part: str) -> list[str]:
    """The questions of one part ("tune" or "held-out") of the off-topic file."""
    questions: dict[str, list[str]] = {}
    current = ""
    for line in OFFTOPIC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
        elif line.strip() and not line.startswith("#"):
            questions.setdefault(current, []).append(line.strip())
    return questions[part]


@dataclass
class Features:
    """Per hit: normalised BM25 (unseen query words counted / not), cosine."""

    bm25_unseen: FloatArray
    bm25_known: FloatArray
    cosine: FloatArray

    def matrix(self, variant: str) -> FloatArray:
        columns = {
            "bm25+cos": [self.bm25_unseen, self.cosine],
            "bm25(known terms)+cos": [self.bm25_known, self.cosine],
            "cos": [np.zeros_like(self.cosine), self.cosine],
            "bm25": [self.bm25_unseen, np.zeros_like(self.cosine)],
        }[variant]
        return np.column_stack(columns)


VARIANTS = ("bm25+cos", "bm25(known terms)+cos", "cos", "bm25")


def features_of(index: TenantIndex, query: str, hits: list[Hit]) -> Features:
    tokens = tokenize(query)
    unseen = index.bm25.max_score(tokens)
    known = index.bm25.max_score(tokens, count_unseen=False)
    return Features(
        np.array([normalised_bm25(h.bm25_score, unseen) for h in hits]),
        np.array([normalised_bm25(h.bm25_score, known) for h in hits]),
        np.array([h.vector_score or 0.0 for h in hits]),
    )


def snapshot_retriever() -> HybridRetriever:
    """A retriever for `search_index` on a loaded snapshot (its store is never read)."""
    return HybridRetriever(IndexStore(Path("/nonexistent"), Embedder()))


@dataclass
class OnTopic:
    """One query's retrieved hits and which of them are relevant."""

    features: Features
    relevant: npt.NDArray[np.bool_]


def on_topic(split: Split, top_k: int) -> list[OnTopic]:
    """Queries with at least one relevant document in their top_k."""
    retriever = snapshot_retriever()
    result = []
    for qid, vector in zip(split.ids, split.vectors, strict=True):
        query = split.queries[qid]
        hits = retriever.search_index(split.index, query, vector, top_k=top_k).hits
        relevant = np.array([split.qrels[qid].get(h.document_id, 0) > 0 for h in hits])
        if relevant.any():
            result.append(OnTopic(features_of(split.index, query, hits), relevant))
    return result


def off_topic(
    index: TenantIndex, embedder: CachedEmbedder, questions: list[str], top_k: int
) -> list[Features]:
    retriever = snapshot_retriever()
    vectors = embedder.embed(questions)
    return [
        features_of(index, q, retriever.search_index(index, q, v, top_k=top_k).hits)
        for q, v in zip(questions, vectors, strict=True)
    ]


def keep_all_share(model: RelevanceModel, queries: list[OnTopic], variant: str, t: float) -> float:
    """Share of queries whose retrieved relevant documents all score >= t."""
    kept = 0
    for q in queries:
        x = q.features.matrix(variant)
        scores = model.scores(x[:, 0], x[:, 1])
        kept += bool((scores[q.relevant] >= t).all())
    return kept / len(queries)


def no_source_share(
    model: RelevanceModel, questions: list[Features], variant: str, t: float
) -> float:
    """Share of off-topic questions none of whose hits scores >= t."""
    rejected = 0
    for f in questions:
        x = f.matrix(variant)
        rejected += bool((model.scores(x[:, 0], x[:, 1]) < t).all())
    return rejected / len(questions)


def threshold_for(
    model: RelevanceModel, queries: list[OnTopic], variant: str, target: float
) -> float:
    """The highest threshold keeping all relevant documents of >= target of the queries."""
    worst = []
    for q in queries:
        x = q.features.matrix(variant)
        worst.append(float(model.scores(x[:, 0], x[:, 1])[q.relevant].min()))
    # Keeping >= target of the queries: the threshold may sit at the (1 - target) quantile of
    # each query's weakest relevant score.
    allowed_misses = int(np.floor((1 - target) * len(worst)))
    return sorted(worst)[allowed_misses]


def pair_regressions(queries: list[OnTopic], noise: list[Features], keep_target: float) -> None:
    """Reference: a logistic regression on the pairs, per feature set, thresholded as chosen."""
    print("\nlogistic regression on (query, passage) pairs, threshold at the keep target:\n")
    print(
        "| features | intercept | w_bm25 | w_cos | threshold | train keep-all "
        "| off-topic no-source |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        pos = np.vstack([q.features.matrix(variant)[q.relevant] for q in queries])
        neg = np.vstack([f.matrix(variant) for f in noise])
        y = np.concatenate([np.ones(len(pos), bool), np.zeros(len(neg), bool)])
        model = fit_logistic(np.vstack([pos, neg]), y)
        t = threshold_for(model, queries, variant, keep_target)
        print(
            f"| {variant} | {model.intercept:.3f} | {model.bm25_weight:.3f} | "
            f"{model.cosine_weight:.3f} | {t:.4f} | "
            f"{keep_all_share(model, queries, variant, t):.3f} | "
            f"{no_source_share(model, noise, variant, t):.3f} |"
        )


def direction_sweep(
    queries: list[OnTopic], noise: list[Features], variant: str, keep_target: float
) -> list[tuple[float, float, float]]:
    """For each angle (0: cosine alone, 90: BM25 alone) of the score `sin a * bm25 + cos a *
    cosine`: the threshold keeping all relevant documents of `keep_target` of the queries, and
    the share of off-topic questions it leaves without sources. Rows (angle, threshold, share)."""
    rows = []
    for angle in np.arange(0.0, 90.1, 5.0):
        direction = np.array([np.sin(np.radians(angle)), np.cos(np.radians(angle))])
        worst = sorted(
            float((q.features.matrix(variant) @ direction)[q.relevant].min()) for q in queries
        )
        t = worst[int(np.floor((1 - keep_target) * len(worst)))]
        # A question with no hits at all (no word of it in the index) has no sources anyway.
        best_off = np.array(
            [float((f.matrix(variant) @ direction).max(initial=-np.inf)) for f in noise]
        )
        rows.append((float(angle), t, float(np.mean(best_off < t))))
    return rows


def tune(top_k: int, keep_target: float) -> None:
    split = load_split("train")
    queries = on_topic(split, top_k)
    noise = off_topic(split.index, split.embedder, offtopic_questions("tune"), top_k)
    print(
        f"train queries with a relevant doc in top {top_k}: {len(queries)} of {len(split.ids)};"
        f" off-topic tuning questions: {len(noise)}; keep target {keep_target}"
    )
    pair_regressions(queries, noise, keep_target)
    print(
        "\nscore = sin(a) * bm25_norm + cos(a) * cosine, threshold at the keep target; "
        "off-topic no-source share (smoothed: mean with both neighbours):\n"
    )
    print("| a (degrees) | " + " | ".join(VARIANTS[:2]) + " |")
    print("| --- | --- | --- |")
    sweeps = {v: direction_sweep(queries, noise, v, keep_target) for v in VARIANTS[:2]}
    smoothed = {
        v: [float(np.mean([r[2] for r in rows[max(0, i - 1) : i + 2]])) for i in range(len(rows))]
        for v, rows in sweeps.items()
    }
    for i, (angle, _, _) in enumerate(sweeps[VARIANTS[0]]):
        cells = [f"{sweeps[v][i][2]:.3f} ({smoothed[v][i]:.3f})" for v in VARIANTS[:2]]
        print(f"| {angle:.0f} | " + " | ".join(cells) + " |")
    # The best smoothed share; ties go to the normalisation that counts unseen words (listed
    # first) and to the smaller angle.
    variant, i = max(
        ((v, i) for v in VARIANTS[:2] for i in range(len(smoothed[v]))),
        key=lambda vi: (smoothed[vi[0]][vi[1]], vi[0] == VARIANTS[0], -vi[1]),
    )
    angle, t, share = sweeps[variant][i]
    calibrate(queries, noise, variant, angle, t, keep_target, share)


def calibrate(
    queries: list[OnTopic],
    noise: list[Features],
    variant: str,
    angle: float,
    t: float,
    keep_target: float,
    share: float,
) -> None:
    """A one-feature logistic regression along the chosen direction: its probability is the
    shipped `relevance`, and the direction's threshold maps to the probability threshold."""
    direction = np.array([np.sin(np.radians(angle)), np.cos(np.radians(angle))])
    pos = np.concatenate([q.features.matrix(variant)[q.relevant] @ direction for q in queries])
    neg = np.concatenate([f.matrix(variant) @ direction for f in noise])
    y = np.concatenate([np.ones(len(pos), bool), np.zeros(len(neg), bool)])
    x = np.column_stack([np.concatenate([pos, neg]), np.zeros(len(y))])
    fitted = fit_logistic(x, y)
    scale = fitted.bm25_weight
    model = RelevanceModel(fitted.intercept, scale * direction[0], scale * direction[1])
    threshold = RelevanceModel(fitted.intercept, scale, 0.0).score(t, 0.0)
    print(
        f"\nchosen: {variant}, a = {angle:.0f} degrees, keep-all "
        f"{keep_all_share(model, queries, variant, threshold - 1e-12):.3f} on train, "
        f"off-topic no-source {share:.3f} on the tuning questions"
    )
    print(
        f"DEFAULT_MODEL = RelevanceModel(intercept={model.intercept:.4f}, "
        f"bm25_weight={model.bm25_weight:.4f}, cosine_weight={model.cosine_weight:.4f})"
    )
    print(f"DEFAULT_THRESHOLD = {math.floor(threshold * 1e4) / 1e4:.4f}  # rounded down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--keep-target", type=float, default=0.97)
    args = parser.parse_args()
    tune(args.top_k, args.keep_target)


if __name__ == "__main__":
    main()
