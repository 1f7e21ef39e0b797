"""What a replica's memos tell a caller who times its requests: how much sooner a passage or a
word is handled when a memo holds it, and whether another tenant's request can leave it there.

    .venv/bin/python -m bench.memo_timing [--passages 8] [--rounds 15]

- ``passages``: SciFact chunks (the first ``--passages`` of 300 to 1,500 characters, as a
  request's sources) handled as a chat request handles its sources: compression's analysis
  (``compress``, the model's tokenizer) and citations' (``cite``). "first seen" empties both
  memos before each round; "kept, same tenant" finds the round before's; "kept by another
  tenant" has another tenant's request handle the same chunks first (what a shared memo gave:
  the figure to compare with "first seen").
- ``key``: the memo's lookup, keyed by tenant (as shipped) against keyed by text alone (the
  memo before), on kept analyses: what keeping tenants apart costs a request.
- ``words``: the word-level memos (compression's stems, the token counter's pieces), per
  word: words seen by the same tenant's request, against new words and the same words for
  another tenant, these two timed at the same point of a round (after other texts).
- ``vocabulary``: a memo scope's first count of SciFact abstracts (what a scope whose words
  were let go pays again), with the pieces of the model's vocabulary looked up (as shipped)
  and with the tokenizer run for every piece the scope has not kept; and how many of SciFact's
  pieces the vocabulary holds.
- ``stemmer``: what PyStemmer's own cache (10,000 words a stemmer, which the service no longer
  uses: it was shared by a thread's tenants) spared: SciFact's first 2,000 abstracts stemmed
  with it and without, per word.

Medians of ``--rounds`` rounds; the arms alternate within each round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import string
import time
from collections.abc import Callable, Hashable
from typing import Any

import Stemmer

from pipeline.answer import citations
from pipeline.context import Passage
from pipeline.model.tokens import _GPT2_PIECES, ModelTokenCounter, load_token_counter
from pipeline.sources import compress as compress_module
from tests.support.data import open_scifact

ANSWER = "The treatment reduced the risk. Patients improved within weeks."


def chunks(count: int) -> list[Passage]:
    found = []
    with open_scifact("corpus.jsonl") as handle:
        for line in handle:
            row = json.loads(line)
            if 300 <= len(row["text"]) <= 1500:
                found.append(Passage(str(row["_id"]), f"{row['_id']}#0", "", row["text"], 1.0))
            if len(found) == count:
                return found
    raise SystemExit("SciFact holds too few chunks")


def clock(fn: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - started) * 1e6


def handle(tenant: str, passages: list[Passage], counter: ModelTokenCounter) -> None:
    """What a chat request does with its sources' texts: compression, then citations."""
    done = compress_module.compress(
        "what reduced the risk", passages, scope=tenant, counter=counter, budget_tokens=384
    )
    citations.cite(ANSWER, done.passages, scope=tenant)


def clear() -> None:
    compress_module.clear_passage_cache()
    citations._analyse.cache_clear()


def passages_part(passages: list[Passage], counter: ModelTokenCounter, rounds: int) -> None:
    times: dict[str, list[float]] = {
        "first seen": [],
        "kept, same tenant": [],
        "kept by another tenant": [],
    }
    for _ in range(rounds):
        clear()
        times["first seen"].append(clock(handle, "acme", passages, counter))
        times["kept, same tenant"].append(clock(handle, "acme", passages, counter))
        times["kept by another tenant"].append(clock(handle, "globex", passages, counter))
    first = statistics.median(times["first seen"])
    print(f"\n### {len(passages)} passages a request (compression and citations)\n")
    print("| the passages' analyses | p50 us | / first seen |")
    print("| --- | --- | --- |")
    for label, values in times.items():
        p50 = statistics.median(values)
        print(f"| {label} | {p50:,.0f} | {p50 / first:.2f} |")


class _TextKeyed(compress_module._KeptIfShort[Any, Any]):
    """The memo before: kept by its arguments alone, whichever tenant asked."""

    def __call__(self, tenant: str, /, *args: Any, **kwargs: Any) -> Any:
        text = args[-1]
        if not isinstance(text, str) or len(text) > compress_module.LONGEST_KEPT_TEXT:
            return self._fn(tenant, *args, **kwargs)
        key: Hashable = (args, tuple(sorted(kwargs.items())))
        return self.kept.remembered(key, lambda: self._fn(tenant, *args, **kwargs), self._weight)


def find_all(memo: Callable[..., Any], counter: ModelTokenCounter, texts: list[str]) -> None:
    for text in texts:
        memo("acme", counter, text)


def key_part(passages: list[Passage], counter: ModelTokenCounter, rounds: int) -> None:
    shipped = compress_module._analyse
    before = _TextKeyed(shipped._fn, compress_module._items)
    texts = [p.text for p in passages]
    for memo in (shipped, before):
        for text in texts:
            memo("acme", counter, text)
    arms: dict[str, list[float]] = {"by tenant and text": [], "by text": []}
    for _ in range(rounds):
        for label, memo in (("by tenant and text", shipped), ("by text", before)):
            runs = [clock(find_all, memo, counter, texts) for _ in range(200)]
            arms[label].append(min(runs))
    ratios = [a / b for a, b in zip(arms["by tenant and text"], arms["by text"], strict=True)]
    print(f"\n### finding {len(texts)} kept analyses\n")
    print("| kept | p50 us |")
    print("| --- | --- |")
    for label, values in arms.items():
        print(f"| {label} | {statistics.median(values):.2f} |")
    print(f"\nby tenant / by text: {statistics.median(ratios):.3f} (median of {rounds} ratios)")


def words_part(counter: ModelTokenCounter, rounds: int) -> None:
    rng = random.Random(7)
    arms = ("seen by the same tenant", "new (control)", "seen by another tenant")
    stems: dict[str, list[float]] = {arm: [] for arm in arms}
    pieces: dict[str, list[float]] = {arm: [] for arm in arms}

    def words() -> str:
        return " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(9)) for _ in range(200)
        )

    def count(tenant: str, text: str) -> int:
        return counter.for_scope(tenant).count(text)

    for n in range(rounds * 2):
        for times, fn in ((stems, compress_module.word_stems), (pieces, count)):
            text = words()
            fn(f"a{n}", text)
            times["seen by the same tenant"].append(clock(fn, f"a{n}", text) / 200)
            for _ in range(20):  # other requests' words in between, as a server has
                fn(f"z{n}", words())
            # New words for a new tenant, and then the first tenant's words for another one:
            # the same place in the round, the same fresh tenant's first count.
            times["new (control)"].append(clock(fn, f"c{n}", words()) / 200)
            times["seen by another tenant"].append(clock(fn, f"b{n}", "".join(text)) / 200)
    print("\n### one word (200 words of 9 random letters a text, tenants fresh each round)\n")
    print(f"| memo | {' us | '.join(arms)} us |")
    print("| --- | --- | --- | --- |")
    for label, times in (("stems (compression)", stems), ("token pieces (counter)", pieces)):
        print(
            f"| {label} | " + " | ".join(f"{statistics.median(times[a]):.2f}" for a in arms) + " |"
        )


def vocabulary_part(counter: ModelTokenCounter, rounds: int) -> None:
    with open_scifact("corpus.jsonl") as handle:
        texts = [json.loads(line)["text"] for line in itertools.islice(handle, 2000)]
    occurrences = [piece for text in texts for piece in _GPT2_PIECES.findall(text)]
    distinct = set(occurrences)
    held = sum(piece in counter.vocabulary for piece in occurrences) / len(occurrences)
    held_distinct = sum(piece in counter.vocabulary for piece in distinct) / len(distinct)
    bare = ModelTokenCounter(counter.tokenizer, counter.source, vocabulary={})
    arms: dict[str, list[float]] = {"with the vocabulary": [], "tokenizer alone": [], "kept": []}
    per = 40  # abstracts a round, each round new ones
    for n in range(rounds):
        batch = texts[n * per % len(texts) :][:per]
        pieces = sum(len(_GPT2_PIECES.findall(text)) for text in batch)
        order = [("with the vocabulary", counter), ("tokenizer alone", bare)]
        for label, which in order if n % 2 else order[::-1]:
            scoped = which.for_scope(f"{label}{n}")
            arms[label].append(clock(scoped.count_many, batch) / pieces)
            if which is counter:
                arms["kept"].append(clock(scoped.count_many, batch) / pieces)
        assert counter.for_scope("check").count_many(batch) == bare.count_many(batch)
    print(
        f"\n### a scope's first count, {per} SciFact abstracts a round; the vocabulary's "
        f"{len(counter.vocabulary):,} pieces hold {held:.0%} of SciFact's first 2,000 "
        f"abstracts' {len(occurrences):,} pieces ({held_distinct:.0%} of {len(distinct):,} "
        "distinct)\n"
    )
    print("| the scope's pieces | us a piece, p50 | / tokenizer alone |")
    print("| --- | --- | --- |")
    alone = statistics.median(arms["tokenizer alone"])
    for label, values in arms.items():
        p50 = statistics.median(values)
        print(f"| {label} | {p50:.2f} | {p50 / alone:.2f} |")


def stemmer_part(rounds: int) -> None:
    words: list[str] = []
    with open_scifact("corpus.jsonl") as handle:
        for line in itertools.islice(handle, 2000):
            words += [w for w in re.findall(r"\b\w\w+\b", json.loads(line)["text"].lower())]
    arms: dict[str, list[float]] = {"cache of 10,000": [], "none": []}
    for _ in range(rounds):
        for label, size in (("cache of 10,000", 10_000), ("none", 0)):
            stemmer = Stemmer.Stemmer("english", size)
            stemmer.stemWords(words)  # what a running thread's stemmer has seen
            arms[label].append(clock(stemmer.stemWords, words) * 1000 / len(words))
    print(f"\n### PyStemmer, {len(words):,} words of SciFact ({len(set(words)):,} distinct)\n")
    print("| its cache | ns a word, p50 |")
    print("| --- | --- |")
    for label, values in arms.items():
        print(f"| {label} | {statistics.median(values):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    counter = load_token_counter()
    if not isinstance(counter, ModelTokenCounter):
        raise SystemExit("the model's tokenizer is missing: run `make model`")
    passages = chunks(args.passages)
    handle("warm", passages, counter)  # the tokenizer's pieces and the stems: warm, as served
    passages_part(passages, counter, args.rounds)
    key_part(passages, counter, args.rounds)
    words_part(counter, args.rounds)
    vocabulary_part(counter, args.rounds)
    stemmer_part(args.rounds)


if __name__ == "__main__":
    main()
