"""The relevance gate (retrieval/relevance.py, constants as shipped) on SciFact TEST and on the
held-out off-topic questions (bench/data/offtopic_questions.txt, "## held-out" part).

    .venv/bin/python -m bench.relevance_eval

Reports, at top_k = 4 (the service's default): the share of test queries whose retrieved
relevant documents are all kept (target >= 0.95), the share of held-out off-topic questions
left with no sources (target >= 0.9), and how both move with the threshold.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.relevance_tune import offtopic_questions, snapshot_retriever
from bench.retrieval_data import load_split
from retrieval.hybrid import Hit
from retrieval.relevance import DEFAULT_MODEL, DEFAULT_THRESHOLD, gate


def evaluate(top_k: int) -> None:
    split = load_split("test")
    retriever = snapshot_retriever()
    on_topic: list[tuple[list[Hit], set[str]]] = []
    kept_on_topic_hits = all_on_topic_hits = 0
    for qid, vector in zip(split.ids, split.vectors, strict=True):
        hits = retriever.search_index(split.index, split.queries[qid], vector, top_k=top_k).hits
        relevant = {d for d, r in split.qrels[qid].items() if r > 0}
        if any(h.document_id in relevant for h in hits):
            on_topic.append((hits, relevant))
        all_on_topic_hits += len(hits)
        kept_on_topic_hits += len(gate(hits, DEFAULT_THRESHOLD).kept)
    questions = offtopic_questions("held-out")
    vectors = split.embedder.embed(questions)
    off_topic = [
        retriever.search_index(split.index, q, v, top_k=top_k).hits
        for q, v in zip(questions, vectors, strict=True)
    ]
    print(f"model: {DEFAULT_MODEL}, threshold {DEFAULT_THRESHOLD}")
    print(
        f"SciFact test: {len(on_topic)} of {len(split.ids)} queries have a relevant document "
        f"in their top {top_k}; held-out off-topic questions: {len(off_topic)}\n"
    )
    print(
        "| threshold | test: all retrieved relevant kept | held-out off-topic: no sources | "
        "test: share of all hits kept |"
    )
    print("| --- | --- | --- | --- |")
    for t in sorted({DEFAULT_THRESHOLD, *np.round(np.linspace(0.1, 0.9, 9), 2).tolist()}):
        keep = np.mean(
            [
                all(
                    h.relevance is not None and h.relevance >= t
                    for h in hits
                    if h.document_id in rel
                )
                for hits, rel in on_topic
            ]
        )
        empty = np.mean([not gate(hits, t).kept for hits in off_topic])
        marker = " (shipped)" if t == DEFAULT_THRESHOLD else ""
        share = f"{kept_on_topic_hits / all_on_topic_hits:.3f}" if t == DEFAULT_THRESHOLD else ""
        print(f"| {t:.4g}{marker} | {keep:.3f} | {empty:.3f} | {share} |")
    print("\nheld-out off-topic questions that keep a source at the shipped threshold:")
    for q, hits in zip(questions, off_topic, strict=True):
        kept = gate(hits, DEFAULT_THRESHOLD).kept
        if kept:
            best = max(h.relevance or 0.0 for h in kept)
            print(f"  {q!r}: {len(kept)} kept, best relevance {best:.3f} ({kept[0].title[:60]!r})")
    example = "What is the capital of France?"
    hits = retriever.search_index(
        split.index, example, split.embedder.embed([example])[0], top_k=top_k
    ).hits
    kept = gate(hits, DEFAULT_THRESHOLD).kept
    print(
        f"\n{example!r}: fused scores {[round(h.score, 3) for h in hits]}, relevance "
        f"{[round(h.relevance or 0.0, 3) for h in hits]}, kept {len(kept)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=4)
    evaluate(parser.parse_args().top_k)


if __name__ == "__main__":
    main()
