"""Prompt compression (pipeline/sources/compress.py) on SciFact: cost, tokens saved, what it keeps.

    .venv/bin/python -m bench.compress_bench                 # cost, tokens, keeps (test split)
    .venv/bin/python -m bench.compress_bench --part splitter # the sentence splitter on abstracts
    .venv/bin/python -m bench.compress_bench --part embedding  # do sentence embeddings pay? (train)

Passages are the cascade's top_k results (HybridRetriever defaults, one chunk per SciFact
abstract, about 300 SmolLM2 tokens each), as the retrieve stage would hand them over. Tokens are
counted with the SmolLM2 tokenizer (`make model` builds it). `token_counts()` is the reusable
part: the same queries, passages and counts for a time-to-first-token run through the service.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench.relevance_tune import snapshot_retriever
from bench.retrieval_data import CachedEmbedder, Split, load_corpus, load_split
from pipeline.context import Passage
from pipeline.model.tokens import (
    ApproximateTokenCounter,
    ModelTokenCounter,
    TokenCounter,
    load_token_counter,
)
from pipeline.sources.compress import (
    DEFAULT_BUDGET_TOKENS,
    Compressed,
    clear_passage_cache,
    compress,
    lexical_scores,
    sentence_spans,
    split_sentences,
)
from retrieval.documents import Document
from retrieval.tokenize import tokenize

IntArray = npt.NDArray[np.int64]

# The layout of pipeline/model/prompt.py's sources block, kept here so the counts do not move when
# the prompt module changes; the instructions are counted as a fixed ~50-token preamble.
PREAMBLE = (
    "You are a helpful assistant. Answer using the sources below when they are relevant, "
    "and cite each source you use by its id in square brackets, like [doc-1]. "
    "If the sources do not contain the answer, say so briefly.\n\nSources:\n\n"
)


def render(passages: list[Passage]) -> str:
    return "\n\n".join(
        f"[{p.document_id}] {p.title + ': ' if p.title else ''}{p.text}" for p in passages
    )


@dataclass
class QueryCount:
    """One query's passages before and after compression, and the prompt tokens of each."""

    query_id: str
    query: str
    passages: list[Passage]
    compressed: Compressed
    prompt_before: int
    prompt_after: int


def passages_for(split: Split, top_k: int) -> list[tuple[str, str, list[Passage]]]:
    retriever = snapshot_retriever()
    result = []
    for qid, vector in zip(split.ids, split.vectors, strict=True):
        query = split.queries[qid]
        hits = retriever.search_index(split.index, query, vector, top_k=top_k).hits
        passages = [Passage(h.document_id, h.chunk_id, h.title, h.text, h.score) for h in hits]
        result.append((qid, query, passages))
    return result


def token_counts(
    split: Split,
    counter: TokenCounter,
    *,
    top_k: int = 8,
    budget: int = DEFAULT_BUDGET_TOKENS,
    represent_all: bool = True,
) -> list[QueryCount]:
    """Every query of `split`: its top_k passages, compressed, and the prompt tokens both ways
    (preamble + rendered sources + the question)."""
    rows = []
    for qid, query, passages in passages_for(split, top_k):
        idf = split.index.bm25.idf_of(tokenize(query))
        done = compress(
            query,
            passages,
            budget_tokens=budget,
            counter=counter,
            idf=idf,
            represent_all=represent_all,
            scope="bench",
        )
        before, after = counter.count_many(
            [
                PREAMBLE + render(passages) + "\n\n" + query,
                PREAMBLE + render(done.passages) + "\n\n" + query,
            ]
        )
        rows.append(QueryCount(qid, query, passages, done, before, after))
    return rows


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def machine_load() -> float:
    """ms for a million-step Python loop: a yardstick for how busy the shared cores were (about
    40 ms on an idle core of this kind of machine)."""
    started = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i
    return (time.perf_counter() - started) * 1000


def cost(rows: list[QueryCount], counter: TokenCounter, rounds: int) -> None:
    """p50/p99 of one compress() call over each query's own passages: passages seen for the
    first time (the per-passage cache cleared before each call) and passages seen before. The
    tokenizer's piece counts and the stems are warm in both, as in a running server."""
    print("\n### cost of compress() per request\n")
    print(f"yardstick before: {machine_load():.0f} ms per 1M-step Python loop\n")
    print("| counter | passages | tokens in (mean) | passages | p50 ms | p99 ms | mean ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, c in (("SmolLM2 tokenizer", counter), ("approximate", ApproximateTokenCounter())):
        for row in rows:  # the vocabulary: every piece and word seen once
            compress(row.query, row.passages, counter=c, scope="bench")
        for label, clear in (("first seen", True), ("seen before", False)):
            times = []
            for _ in range(rounds):
                for row in rows:
                    if clear:
                        clear_passage_cache()
                    started = time.perf_counter()
                    compress(row.query, row.passages, counter=c, scope="bench")
                    times.append((time.perf_counter() - started) * 1000)
            n = statistics.mean(len(r.passages) for r in rows)
            tokens = statistics.mean(r.compressed.tokens_before for r in rows)
            print(
                f"| {name} | {n:.0f} | {tokens:.0f} | {label} | {percentile(times, 50):.2f} | "
                f"{percentile(times, 99):.2f} | {statistics.mean(times):.2f} |"
            )
    print(f"\nyardstick after: {machine_load():.0f} ms")


def tokens_and_keeps(split: Split, rows: list[QueryCount], budget: int) -> None:
    """Tokens before/after, and the share of retrieved relevant documents still represented."""
    before = [r.compressed.tokens_before for r in rows]
    after = [r.compressed.tokens_after for r in rows]
    prompt_before = [r.prompt_before for r in rows]
    prompt_after = [r.prompt_after for r in rows]
    retrieved_relevant = kept_relevant = represented = passages = 0
    for r in rows:
        kept_docs = {p.document_id for p in r.compressed.passages}
        for p in r.passages:
            passages += 1
            represented += p.document_id in kept_docs
            if split.qrels[r.query_id].get(p.document_id, 0) > 0:
                retrieved_relevant += 1
                kept_relevant += p.document_id in kept_docs
    print(f"\n### tokens, budget {budget}, {len(rows)} queries\n")
    print("| measure | before | after | ratio |")
    print("| --- | --- | --- | --- |")
    print(
        f"| passage tokens, mean | {statistics.mean(before):.0f} | {statistics.mean(after):.0f} "
        f"| {sum(before) / sum(after):.2f}x |"
    )
    print(
        f"| prompt tokens (preamble + sources + question), mean | "
        f"{statistics.mean(prompt_before):.0f} | {statistics.mean(prompt_after):.0f} | "
        f"{sum(prompt_before) / sum(prompt_after):.2f}x |"
    )
    print(
        f"| prompt tokens, p50 | {percentile(prompt_before, 50):.0f} | "
        f"{percentile(prompt_after, 50):.0f} | |"
    )
    over = sum(a > budget for a in after)
    print(
        f"\nover budget: {over} of {len(rows)}; passages represented: "
        f"{represented}/{passages} = {represented / passages:.3f}"
    )
    print(
        f"retrieved relevant documents with >= 1 sentence kept: {kept_relevant}/"
        f"{retrieved_relevant} = {kept_relevant / max(1, retrieved_relevant):.3f}"
    )


def _boundaries(spans: list[tuple[int, int]]) -> set[int]:
    return {start for start, _ in spans[1:]}


def splitter(docs: list[Document]) -> None:
    """Our splitter against pysbd (rule-based, English) and a naive regex, on every abstract."""
    import pysbd

    texts = [d.text for d in docs]
    reference = pysbd.Segmenter(language="en", clean=False, char_span=True)
    naive = re.compile(r"(?<=[.!?])\s+")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    ours = [sentence_spans(t) for t in texts]
    timings["ours"] = time.perf_counter() - started
    started = time.perf_counter()
    theirs = [[(s.start, s.end) for s in reference.segment(t)] for t in texts]
    timings["pysbd"] = time.perf_counter() - started
    started = time.perf_counter()
    plain = [[(m.end(), 0) for m in naive.finditer(t)] for t in texts]
    timings["naive"] = time.perf_counter() - started
    print(f"\n### sentence splitting, {len(texts)} SciFact abstracts\n")
    print(
        "| splitter | sentences | boundaries agreeing with pysbd: precision | recall | "
        "ms per abstract |"
    )
    print("| --- | --- | --- | --- | --- |")
    gold = [
        {_first_char(t, b) for b in _boundaries(spans)}
        for t, spans in zip(texts, theirs, strict=True)
    ]
    for name, found in (("ours", ours), ("naive regex", [[(0, 0), *p] for p in plain])):
        got = [
            {_first_char(t, b) for b in _boundaries(spans)}
            for t, spans in zip(texts, found, strict=True)
        ]
        hits = sum(len(g & r) for g, r in zip(got, gold, strict=True))
        n_got, n_gold = sum(map(len, got)), sum(map(len, gold))
        key = "ours" if name == "ours" else "naive"
        print(
            f"| {name} | {n_got + len(texts)} | {hits / n_got:.3f} | {hits / n_gold:.3f} | "
            f"{timings[key] * 1000 / len(texts):.3f} |"
        )
    print(
        f"| pysbd | {sum(map(len, gold)) + len(texts)} | 1 | 1 | "
        f"{timings['pysbd'] * 1000 / len(texts):.3f} |"
    )
    _disagreements(texts, ours, gold)


def _first_char(text: str, offset: int) -> int:
    """Boundaries compared at the first non-space character after them."""
    while offset < len(text) and text[offset].isspace():
        offset += 1
    return offset


def _disagreements(
    texts: list[str], ours: list[list[tuple[int, int]]], gold: list[set[int]]
) -> None:
    shown = {"only ours": 0, "only pysbd": 0}
    for text, spans, want in zip(texts, ours, gold, strict=True):
        got = {_first_char(text, b) for b in _boundaries(spans)}
        for label, offsets in (("only ours", got - want), ("only pysbd", want - got)):
            for b in sorted(offsets):
                if shown[label] < 8:
                    shown[label] += 1
                    print(f"  {label}: ...{text[max(0, b - 50) : b]!r} | {text[b : b + 30]!r}...")


def embedding_gain(split: Split, counter: TokenCounter, top_k: int, budget: int, n: int) -> None:
    """Sentence ranking by lexical overlap vs. MiniLM sentence embeddings, on SciFact train.

    No sentence-level labels exist in BEIR's SciFact, so a sentence counts as relevant when its
    document is a relevant one: a scorer is better when it puts the relevant documents'
    sentences first (MRR of the first such sentence, P@1), and when the budget it fills holds
    more of their tokens.
    """
    embedder = CachedEmbedder("minilm-sentences")
    rng = np.random.default_rng(0)
    chosen = set(rng.permutation(split.ids)[:n].tolist())
    sub = Split(
        split.embedder,
        split.qrels,
        split.queries,
        [q for q in split.ids if q in chosen],
        split.vectors[[i for i, q in enumerate(split.ids) if q in chosen]],
        split.index,
    )
    metrics: dict[str, list[tuple[float, float, float]]] = {}
    for qid, query, passages in passages_for(sub, top_k):
        relevant_docs = {d for d, r in split.qrels[qid].items() if r > 0}
        sentences, labels = [], []
        for p in passages:
            for s in split_sentences(p.text):
                sentences.append(s)
                labels.append(p.document_id in relevant_docs)
        if not any(labels):
            continue
        label = np.array(labels)
        tokens = np.array(counter.count_many(sentences))
        qvec = split.vectors[split.ids.index(qid)]
        dense = embedder.embed(sentences) @ qvec
        index_idf = split.index.bm25.idf_of(tokenize(query))
        lexical = np.array(lexical_scores(query, sentences, index_idf))
        scorers = {
            "lexical, index idf": lexical,
            "lexical, local idf": np.array(lexical_scores(query, sentences)),
            "dense (sentence embeddings)": dense,
        }
        for alpha in (0.25, 0.5, 1.0, 2.0):
            scorers[f"lexical + {alpha} x dense"] = lexical + alpha * dense
        for name, score in scorers.items():
            metrics.setdefault(name, []).append(_ranking(score, label, tokens, budget))
    print(
        f"\n### sentence scoring on SciFact train ({len(next(iter(metrics.values())))} "
        f"queries with a relevant document in the top {top_k})\n"
    )
    print("| scorer | MRR (first relevant-doc sentence) | P@1 | relevant share of budget |")
    print("| --- | --- | --- | --- |")
    for name, values in metrics.items():
        mrr, p1, share = (statistics.mean(v[i] for v in values) for i in range(3))
        print(f"| {name} | {mrr:.3f} | {p1:.3f} | {share:.3f} |")


def _ranking(
    score: npt.NDArray[np.floating], label: npt.NDArray[np.bool_], tokens: IntArray, budget: int
) -> tuple[float, float, float]:
    order = np.lexsort((np.arange(len(score)), -score))
    first = int(np.flatnonzero(label[order])[0])
    used = kept = 0
    for i in order:
        if used + tokens[i] <= budget:
            used += int(tokens[i])
            kept += int(tokens[i]) if label[i] else 0
    return 1 / (first + 1), float(first == 0), kept / max(1, used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["main", "splitter", "embedding"], default="main")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET_TOKENS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=400, help="train sample (embedding)")
    parser.add_argument(
        "--no-represent-all",
        action="store_true",
        help="fill by score alone, without first keeping each passage's best sentence",
    )
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    counter = load_token_counter()
    if not isinstance(counter, ModelTokenCounter):
        raise SystemExit("the SmolLM2 tokenizer is missing: `make model` builds it")
    if args.part == "splitter":
        splitter(load_corpus())
        return
    if args.part == "embedding":
        embedding_gain(load_split("train"), counter, args.top_k, args.budget, args.queries)
        return
    split = load_split("test")
    rows = token_counts(
        split,
        counter,
        top_k=args.top_k,
        budget=args.budget,
        represent_all=not args.no_represent_all,
    )
    if not args.skip_cost:
        cost(rows, counter, args.rounds)
    tokens_and_keeps(split, rows, args.budget)


if __name__ == "__main__":
    main()
