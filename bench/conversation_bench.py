"""Follow-up questions on SciFact: last message only, the conversation, one standalone question.

    .venv/bin/python -m bench.conversation_bench            # report half (SciFact test claims)
    .venv/bin/python -m bench.conversation_bench --tune     # grid over FollowUpWeights, tune half

For each conversation of bench/data/conversations.jsonl (bench/build_conversations.py) the
follow-up turn is searched three ways with the service's cascade (HybridRetriever's defaults)
over SciFact indexed as bench.retrieval_quality indexes it (same index, same cached
embeddings): the last user message alone (what the service did before), the conversation
(pipeline.sources.conversation: earlier user turns' words at a lower BM25 weight, blended
vectors), and the same information asked as one standalone question. It prints nDCG@10 of the
follow-up per case type, how often the relevance gate leaves the follow-up without any source,
how often a topic shift ranks an earlier topic's document first, and the latency each way
(embedding included, with the real model uncached, as the service does it: the follow-up and its
earlier turns in one batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.build_conversations import CASES, OUTPUT
from bench.retrieval_data import CachedEmbedder, build_scifact_index, ndcg_at_k
from pipeline.sources.conversation import (
    DEFAULT_WEIGHTS,
    ConversationQuery,
    FollowUpWeights,
    build_query,
)
from retrieval.embeddings import Embedder
from retrieval.hybrid import HybridRetriever, SearchResult
from retrieval.index import TenantIndex
from retrieval.relevance import DEFAULT_THRESHOLD
from retrieval.store import IndexStore
from retrieval.vectors import FloatArray

TOP_K = 10


@dataclass(frozen=True)
class Conversation:
    id: str
    half: str
    case: str
    messages: list[dict[str, Any]]
    standalone: str
    relevant: dict[str, int]
    earlier_relevant: dict[str, int]

    @property
    def follow_up(self) -> str:
        return str(self.messages[-1]["content"])


def load_conversations(half: str, path: Path = OUTPUT) -> list[Conversation]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [
        Conversation(
            r["id"],
            r["half"],
            r["case"],
            r["messages"],
            r["standalone"],
            r["relevant"],
            r.get("earlier_relevant", {}),
        )
        for r in rows
        if r["half"] == half
    ]


class Bench:
    """The index, the retriever and every text's vector (from the on-disk cache)."""

    def __init__(self, conversations: list[Conversation], embedder: CachedEmbedder) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            self.index: TenantIndex = build_scifact_index(Path(tmp), embedder)
        self.retriever = HybridRetriever(IndexStore(Path("/nonexistent"), embedder))
        texts = sorted(
            {c.standalone for c in conversations}
            | {str(m["content"]) for c in conversations for m in c.messages}
        )
        self.vectors = dict(zip(texts, embedder.embed(texts), strict=True))

    def search(
        self, text: str, vector: FloatArray, query: ConversationQuery | None
    ) -> SearchResult:
        context = query.context_terms if query is not None else ()
        return self.retriever.search_index(
            self.index, text, vector, top_k=TOP_K, context_terms=context
        )

    def last_message(self, c: Conversation) -> SearchResult:
        return self.search(c.follow_up, self.vectors[c.follow_up], None)

    def standalone(self, c: Conversation) -> SearchResult:
        return self.search(c.standalone, self.vectors[c.standalone], None)

    def conversation(self, c: Conversation, weights: FollowUpWeights) -> SearchResult:
        query = build_query(c.messages, weights)
        vector = query.blend(self.vectors[query.text], [self.vectors[t] for t in query.earlier])
        return self.search(query.text, vector, query)


@dataclass
class Scores:
    """Per conversation: nDCG@10, whether the gate left any source, an old topic first."""

    ndcg: list[float]
    sourced: list[bool]
    old_first: list[bool]


def score(conversations: list[Conversation], run: Callable[[Conversation], SearchResult]) -> Scores:
    out = Scores([], [], [])
    for c in conversations:
        hits = run(c).hits
        ranked = [h.document_id for h in hits]
        out.ndcg.append(ndcg_at_k(ranked, c.relevant))
        out.sourced.append(
            any(h.relevance is not None and h.relevance >= DEFAULT_THRESHOLD for h in hits[:5])
        )
        out.old_first.append(bool(ranked) and ranked[0] in c.earlier_relevant)
    return out


def by_case(conversations: list[Conversation], values: list[Any], case: str) -> list[Any]:
    return [v for c, v in zip(conversations, values, strict=True) if case in ("all", c.case)]


def mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def report(conversations: list[Conversation], bench: Bench, weights: FollowUpWeights) -> None:
    runs = {
        "last message only": score(conversations, bench.last_message),
        "conversation": score(conversations, lambda c: bench.conversation(c, weights)),
        "standalone question": score(conversations, bench.standalone),
    }
    dependent = [c for c in conversations if c.case != "topic_shift"]
    print(f"{len(conversations)} follow-ups ({len(dependent)} dependent), weights {weights}")
    print("| nDCG@10 of the follow-up | " + " | ".join(runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for case in (*CASES, "all"):
        cells = [mean(by_case(conversations, s.ndcg, case)) for s in runs.values()]
        n = len(by_case(conversations, conversations, case))
        print(f"| {case} ({n}) | " + " | ".join(f"{v:.3f}" for v in cells) + " |")
    cells = [
        mean(v for c, v in zip(conversations, s.ndcg, strict=True) if c.case != "topic_shift")
        for s in runs.values()
    ]
    print("| dependent follow-ups | " + " | ".join(f"{v:.3f}" for v in cells) + " |")
    sourced = [mean(map(float, s.sourced)) for s in runs.values()]
    print("| share with a source past the gate | " + " | ".join(f"{v:.2f}" for v in sourced) + " |")
    shifts = [
        mean(map(float, by_case(conversations, s.old_first, "topic_shift"))) for s in runs.values()
    ]
    print(
        "| topic shift: old topic's document first | "
        + " | ".join(f"{v:.2f}" for v in shifts)
        + " |"
    )
    decided: dict[str, dict[str, int]] = {}
    for c in conversations:
        reason = build_query(c.messages, weights).reason
        decided.setdefault(c.case, {}).setdefault(reason, 0)
        decided[c.case][reason] += 1
    print("read as:", json.dumps(decided, sort_keys=True))


def tune(conversations: list[Conversation], bench: Bench) -> FollowUpWeights:
    """A small grid on the tune half, in two steps: the weights of follow-ups with a cue (best
    mean nDCG@10 of the dependent cases, fragments searched alone), then how short a message
    without a cue must be to count as a fragment and the share of the weights it gets (best
    dependent nDCG@10 among the settings that leave the topic shifts at least as good as
    last-message-only)."""
    shifts = [c for c in conversations if c.case == "topic_shift"]
    dependent = [c for c in conversations if c.case != "topic_shift"]
    floor = mean(score(shifts, bench.last_message).ndcg)

    def measure(weights: FollowUpWeights) -> tuple[float, float]:
        def run(c: Conversation) -> SearchResult:
            return bench.conversation(c, weights)

        return mean(score(dependent, run).ndcg), mean(score(shifts, run).ndcg)

    results = []
    # Earlier turns weigh less than the message itself, on both sides (below 1).
    grid = itertools.product((0.3, 0.5, 0.7, 0.9), (0.3, 0.5, 0.7, 0.9), (0.5, 1.0), (1, 2))
    for terms, vector, decay, turns in grid:
        weights = FollowUpWeights(terms, vector, decay, turns, fragment=0.0)
        results.append((*measure(weights), weights))
    results.sort(key=lambda r: -r[0])
    print(f"topic shifts, last message only: {floor:.3f}")
    print(
        "| terms | vector | decay | turns | fragment share | fragment words | dependent | shift |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def row(dep: float, shift: float, w: FollowUpWeights) -> None:
        print(f"| {w.terms} | {w.vector} | {w.decay} | {w.turns} | {w.fragment} | "
              f"{w.fragment_words} | {dep:.3f} | {shift:.3f} |")  # fmt: skip

    for dep, shift, w in results[:6]:
        row(dep, shift, w)
    best = results[0][2]
    fragments = []
    for share, words in itertools.product((0.3, 0.5, 0.7, 1.0), (4, 5, 6, 8, 12)):
        weights = dataclasses.replace(best, fragment=share, fragment_words=words)
        dep, shift = measure(weights)
        fragments.append((dep, shift, weights))
        row(dep, shift, weights)
    # Of the settings that keep the topic shifts, those within 0.01 of the best (a difference
    # this set cannot tell from noise), the one that leans least on earlier turns.
    allowed = [r for r in fragments if r[1] >= floor] or [(0.0, 0.0, best)]
    top = max(r[0] for r in allowed)
    close = [r[2] for r in allowed if r[0] >= top - 0.01]
    chosen = min(close, key=lambda w: (w.fragment, w.fragment_words))
    print(f"chosen: {chosen}")
    return chosen


def latency(conversations: list[Conversation], bench: Bench, weights: FollowUpWeights) -> None:
    """Median ms per follow-up, the real model embedding uncached, last-only vs conversation
    (alternating, three rounds); the conversation embeds its turns in one batch, as the
    service's query batcher does."""
    model = Embedder()
    model.warm_up()
    model.embed(["warm up"])
    plain: list[float] = []
    conversational: list[float] = []
    dependent: list[tuple[float, float]] = []
    for _ in range(3):
        for c in conversations:
            started = time.perf_counter()
            vector = model.embed([c.follow_up])[0]
            bench.search(c.follow_up, vector, None)
            alone = time.perf_counter() - started
            started = time.perf_counter()
            query = build_query(c.messages, weights)
            vectors = model.embed([query.text, *query.earlier])
            bench.search(query.text, query.blend(vectors[0], list(vectors[1:])), query)
            together = time.perf_counter() - started
            plain.append(alone)
            conversational.append(together)
            if query.earlier:
                dependent.append((alone, together))
    med = statistics.median
    print(
        f"latency, ms per follow-up (median of {len(plain)}): last message only "
        f"{med(plain) * 1000:.1f}, conversation {med(conversational) * 1000:.1f} "
        f"(ratio {med(conversational) / med(plain):.2f}); on the {len(dependent)} searched with "
        f"earlier turns: {med(a for a, _ in dependent) * 1000:.1f} vs "
        f"{med(b for _, b in dependent) * 1000:.1f} "
        f"(ratio {med(b for _, b in dependent) / med(a for a, _ in dependent):.2f})"
    )


REWRITE_PROMPT = (
    "Rewrite the user's last question as one standalone question that names its topic, "
    "using the earlier turns. Reply with the question only."
)


def rewrite(
    conversations: list[Conversation], bench: Bench, weights: FollowUpWeights, url: str, n: int
) -> None:
    """What the small model route would give instead: the first `n` dependent follow-ups
    rewritten by the model at `url` (greedy, 48 tokens), their nDCG@10 beside the cheap
    conversational query's, and the model call's latency."""
    import httpx

    chosen = [c for c in conversations if c.case != "topic_shift"][:n]
    model = Embedder()
    model.warm_up()
    cheap: list[float] = []
    rewritten: list[float] = []
    took: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for c in chosen:
            history = "\n".join(f"{m['role'].title()}: {m['content']}" for m in c.messages)
            started = time.perf_counter()
            response = client.post(
                "/v1/chat/completions",
                json={
                    "model": "smollm2",
                    "messages": [
                        {"role": "system", "content": REWRITE_PROMPT},
                        {"role": "user", "content": f"{history}\n\nStandalone question:"},
                    ],
                    "max_tokens": 48,
                    "temperature": 0,
                },
            )
            took.append(time.perf_counter() - started)
            response.raise_for_status()
            text = response.json()["choices"][0]["message"]["content"].strip() or c.follow_up
            hits = bench.search(text, model.embed([text])[0], None).hits
            rewritten.append(ndcg_at_k([h.document_id for h in hits], c.relevant))
            ranked = [h.document_id for h in bench.conversation(c, weights).hits]
            cheap.append(ndcg_at_k(ranked, c.relevant))
    print(
        f"small-model rewrite of {len(chosen)} dependent follow-ups: nDCG@10 {mean(rewritten):.3f} "
        f"(conversational query on the same: {mean(cheap):.3f}); model call median "
        f"{statistics.median(took) * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", action="store_true", help="grid over the weights, tune half")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--rewrite-url", help="a vLLM to measure small-model rewrites against")
    parser.add_argument("--rewrite-count", type=int, default=40)
    args = parser.parse_args()
    half = "tune" if args.tune else "report"
    conversations = load_conversations(half)
    bench = Bench(conversations, CachedEmbedder())
    print(f"SciFact, {half} half: {len(bench.index)} documents (one chunk each)")
    weights = tune(conversations, bench) if args.tune else DEFAULT_WEIGHTS
    report(conversations, bench, weights)
    if not args.no_latency:
        latency(conversations, bench, weights)
    if args.rewrite_url:
        rewrite(conversations, bench, weights, args.rewrite_url, args.rewrite_count)


if __name__ == "__main__":
    main()
