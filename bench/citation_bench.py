"""Citation precision, recall and cost on the labelled set (bench/data/citations.jsonl).

A prediction is a (sentence, passage) pair; precision and recall are over those pairs against
the labels, a span is right when it is the labelled source sentence, and a sentence is judged
right when its ``supported`` flag is. The threshold is tuned on the even-numbered answers and
reported on the odd-numbered ones (with ``NEAR_BEST``, how close to the best a second source
must come), with the module's own ``THRESHOLD`` and ``NEAR_BEST`` beside them.

Cost: the median time of ``pipeline.answer.citations.cite`` per answer (about 200 tokens over 4
passages), the passages seen for the first time (their analysis cache cleared: the worst case)
and seen before (retrieval hands the same chunks out again and again). The same for the
answer streamed in pieces of 4 characters, as the tracker is fed in a stream.

``--embeddings`` also scores each source sentence by the cosine of its MiniLM embedding with
the answer sentence's (``retrieval.embeddings.Embedder``, as the service loads it), alone and
mixed with the lexical score, tuned and reported the same way, with its cost per answer.

    python -m bench.citation_bench [--embeddings]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np

from bench.retrieval_data import load_corpus
from pipeline.answer import citations
from pipeline.answer.citations import Attributor, CitationTracker, cite, segments
from pipeline.answer.events import CitedSource
from pipeline.context import Passage
from pipeline.model.tokens import load_token_counter

DATA = Path(__file__).parent / "data" / "citations.jsonl"
GRID = [round(0.2 + 0.025 * i, 3) for i in range(25)]
NEAR_GRID = [0.5, 0.6, 0.7, 0.8, 0.9]

# A sentence's predicted sources: its index -> the cited sources.
Predict = Callable[[dict[str, Any], list[Passage]], list[tuple[CitedSource, ...]]]


@dataclass
class Scores:
    precision: float
    recall: float
    f1: float
    spans: float  # right pairs whose span is the labelled one
    flags: float  # sentences whose supported flag is right

    def line(self) -> str:
        return (
            f"precision {self.precision:.3f}  recall {self.recall:.3f}  F1 {self.f1:.3f}  "
            f"spans {self.spans:.3f}  supported-flag accuracy {self.flags:.3f}"
        )


def load(path: Path = DATA) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def passages_of(row: dict[str, Any], corpus: dict[str, Any]) -> list[Passage]:
    return [
        Passage(d, f"{d}#0", corpus[d].title, corpus[d].text, 1.0 / (i + 1))
        for i, d in enumerate(row["passages"])
    ]


def score(
    rows: Iterable[dict[str, Any]], predictions: Sequence[list[tuple[CitedSource, ...]]]
) -> Scores:
    right = predicted = labelled = spans = flags = sentences = 0
    for row, predicted_row in zip(rows, predictions, strict=True):
        for label, cited in zip(row["sentences"], predicted_row, strict=True):
            gold = {s["index"]: tuple(s["span"]) for s in label["sources"]}
            predicted += len(cited)
            labelled += len(gold)
            sentences += 1
            flags += bool(cited) == label["supported"]
            for source in cited:
                if source.index in gold:
                    right += 1
                    spans += (source.start, source.end) == gold[source.index]
    precision = right / predicted if predicted else 1.0
    recall = right / labelled if labelled else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Scores(precision, recall, f1, spans / right if right else 0.0, flags / sentences)


def lexical(threshold: float, near_best: float) -> Predict:
    def predict(row: dict[str, Any], passages: list[Passage]) -> list[tuple[CitedSource, ...]]:
        tracker = CitationTracker(
            Attributor(passages, threshold=threshold, near_best=near_best, scope="bench")
        )
        return [c.sources for c in [*tracker.feed(row["answer"]), *tracker.end()]]

    return predict


Make = Callable[[float, float], Predict]


def tune(rows: list[dict[str, Any]], corpus: dict[str, Any], make: Make) -> tuple[float, float]:
    best = (-1.0, 0.0, 0.0)
    for threshold in GRID:
        for near_best in NEAR_GRID:
            predict = make(threshold, near_best)
            scores = score(rows, [predict(r, passages_of(r, corpus)) for r in rows])
            best = max(best, (round(scores.f1, 6), threshold, near_best))
    return best[1], best[2]


def timed(
    rows: list[dict[str, Any]], corpus: dict[str, Any], run: Callable[..., Any], *, cold: bool
):
    times = []
    for row in rows:
        passages = passages_of(row, corpus)
        if cold:
            citations._analyse.cache_clear()
        started = time.perf_counter()
        run(row["answer"], passages)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times), float(np.percentile(times, 95))


def streamed(answer: str, passages: list[Passage]) -> None:
    tracker = CitationTracker(Attributor(passages, scope="bench"))
    for i in range(0, len(answer), 4):
        tracker.feed(answer[i : i + 4])
    tracker.end()


class EmbeddingScorer:
    """Cosine of MiniLM embeddings, alone (``mix`` 0) or mixed with the lexical support."""

    def __init__(self) -> None:
        from retrieval.embeddings import Embedder

        self.embedder = Embedder()
        self.embedder.warm_up()
        self.memo = True  # tuning re-chooses from the same cosines; timing turns it off
        self._memo: dict[tuple[str, tuple[str, ...]], Any] = {}

    def vectors(self, texts: list[str]) -> Any:
        return np.asarray(self.embedder.embed(texts), dtype=np.float32)

    def predict(self, threshold: float, near_best: float, mix: float) -> Predict:
        def run(row: dict[str, Any], passages: list[Passage]) -> list[tuple[CitedSource, ...]]:
            return self.cite(row["answer"], passages, threshold, near_best, mix)

        return run

    def cite(
        self, answer: str, passages: list[Passage], threshold: float, near_best: float, mix: float
    ) -> list[tuple[CitedSource, ...]]:
        attributor = Attributor(passages, threshold=threshold, near_best=near_best, scope="bench")
        sentences = [answer[a:b] for a, b in segments(answer)]
        key = (answer, tuple(p.chunk_id for p in passages))
        cosines = self._memo.get(key) if self.memo else None
        if cosines is None:
            spans = attributor.spans
            owners = attributor.owners
            sources = [passages[o].text[a:b] for o, (a, b) in zip(owners, spans, strict=True)]
            vectors = self.vectors(sentences + sources)
            cosines = vectors[: len(sentences)] @ vectors[len(sentences) :].T
            self._memo[key] = cosines
        out = []
        for i, sentence in enumerate(sentences):
            lexical_support = attributor.support(sentence) if mix > 0 else {}
            support = {
                sid: mix * lexical_support.get(sid, 0.0) + (1 - mix) * max(float(c), 0.0)
                for sid, c in enumerate(cosines[i])
            }
            out.append(attributor.choose(support))
        return out


def report(name: str, tune_rows, test_rows, corpus, make: Make) -> None:
    threshold, near_best = tune(tune_rows, corpus, make)
    predict = make(threshold, near_best)
    scores = score(test_rows, [predict(r, passages_of(r, corpus)) for r in test_rows])
    print(f"{name}: tuned threshold {threshold:.3f}, near_best {near_best} -> {scores.line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embeddings", action="store_true")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    rows = load(args.data)
    corpus = {d.id: d for d in load_corpus()}
    tune_rows, test_rows = rows[0::2], rows[1::2]
    n_sentences = sum(len(r["sentences"]) for r in test_rows)
    tokens = statistics.median(load_token_counter().count_many([r["answer"] for r in test_rows]))
    print(
        f"{len(rows)} answers: tuned on {len(tune_rows)}, reported on {len(test_rows)} "
        f"({n_sentences} sentences; median {tokens:.0f} SmolLM2 tokens an answer; 4 passages)"
    )
    report("lexical", tune_rows, test_rows, corpus, lexical)
    module = lexical(citations.THRESHOLD, citations.NEAR_BEST)
    fixed = score(test_rows, [module(r, passages_of(r, corpus)) for r in test_rows])
    print(
        f"lexical at the module's THRESHOLD {citations.THRESHOLD}, NEAR_BEST "
        f"{citations.NEAR_BEST}: {fixed.line()}"
    )
    flags: dict[str, list[bool]] = {}
    for row in test_rows:
        found_row = cite(row["answer"], passages_of(row, corpus), scope="bench")
        for label, found in zip(row["sentences"], found_row, strict=True):
            flags.setdefault(label["kind"], []).append(found.supported == label["supported"])
    for kind, right in flags.items():
        print(f"  {kind:14s} {len(right):4d} sentences, supported flag right {mean(right):.3f}")
    cold = timed(test_rows, corpus, functools.partial(cite, scope="bench"), cold=True)
    warm = timed(test_rows, corpus, functools.partial(cite, scope="bench"), cold=False)
    stream_cold = timed(test_rows, corpus, streamed, cold=True)
    print(
        f"cost per answer, lexical: median {cold[0]:.2f} ms (p95 {cold[1]:.2f}) passages first "
        f"seen; {warm[0]:.2f} ms (p95 {warm[1]:.2f}) seen before; streamed in 4-character pieces "
        f"{stream_cold[0]:.2f} ms (p95 {stream_cold[1]:.2f})"
    )
    if args.embeddings:
        scorer = EmbeddingScorer()
        report("embeddings", tune_rows, test_rows, corpus, lambda t, n: scorer.predict(t, n, 0.0))
        report(
            "lexical+embeddings (0.5/0.5)",
            tune_rows,
            test_rows,
            corpus,
            lambda t, n: scorer.predict(t, n, 0.5),
        )
        scorer.memo = False
        spent = timed(
            test_rows,
            corpus,
            lambda a, p: scorer.cite(a, p, citations.THRESHOLD, citations.NEAR_BEST, 0.5),
            cold=True,
        )
        print(f"cost per answer, with embeddings: median {spent[0]:.1f} ms (p95 {spent[1]:.1f})")


if __name__ == "__main__":
    main()
