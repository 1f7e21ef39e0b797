"""What the request path's memos hold after texts a hostile or careless caller makes, with
their weight budgets and without them (the memos before: bounded by entries alone).

    .venv/bin/python -m bench.memo_memory [--entries 4096] [--rounds 1] [--memos ...]

Each row runs in a process of its own, the two configurations alternating. What a memo holds
is read with tracemalloc: the bytes still allocated after the texts, less those left once the
memo is emptied (resident memory would hide it: the heap reuses what earlier work freed).

- ``pii``: the ``guard_in`` stage (default policy: PII redacted, at most 4,096 input tokens)
  given distinct chat requests, each one user message of as many e-mail addresses as its
  tokens allow. Budget: ``MEMO_FINDINGS`` findings.
- ``injection``: the same stage given distinct messages packed with known attacks (the
  repository's own injection texts, chosen for the most rule signals within the token cap);
  each request is refused, its verdict kept. Budget: ``MEMO_SIGNALS`` signals.
- ``passages``: compression's and citations' per-passage analyses given distinct passages as
  long as is kept (8,192 characters) and as dense as the chunker lets a passage be (a sentence
  per word, seven hyphenated terms a word): a tenant with an ingest key stores such chunks,
  and every chat request that retrieves them has them analysed. Budget: ``KEPT_ITEMS`` each.
- ``pieces``: the model's token counter given 65,536-character texts of 63-letter words from
  beyond the Basic Multilingual Plane (inputs are counted even when refused). Budget:
  ``PIECE_CACHE_CHARS`` (the counter's ``pieces.chars``); ``--entries`` is capped so the
  cache's 200,000 pieces are reached.
- ``stems``: compression's stem cache given the same kind of words. Budget:
  ``STEMS.chars``.
- ``patterns``: distinct tool-schema patterns ``x<n>\\pL{400}`` (a Unicode class repeated: a
  4-8 MB program each): before, compiled by ``re2.compile`` (the re2 module's cache of 128
  keeps them); now by ``check_patterns`` (each accepted, its verdict kept, the program not).
  RE2's memory is C++, which tracemalloc does not see: this row reads resident memory in a
  fresh process, after glibc gave back what is free. Entries are capped at 128.
- ``bpe``: the tokenizer library's own BPE cache (Rust: resident memory too) given texts of
  distinct 250-character runs of punctuation (261 a text): before, as the library ships it
  (10,000 words, never let go); now resized to none by ``ModelTokenCounter``. Then SciFact's
  first 500 abstracts are counted by a fresh counter, as the time check.

Then a text seen again (an everyday question, an ordinary passage) shows the memo still
answers it: its second use against its first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ADDRESSES = 580  # 7 approximate tokens each: 4,060 of the default 4,096
PASSAGE_WORDS = 180  # retrieval.documents.DEFAULT_MAX_WORDS
ROOT = Path(__file__).resolve().parents[1]
INJECTION_TEXTS = (
    "pipeline/guards/data/injection_exemplars.jsonl",
    "bench/data/injection_eval.jsonl",
    "bench/data/injection_dev_extra.jsonl",
)


def letters(i: int) -> str:
    """``i``'s six decimal digits as letters a to j."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[int(d)] for d in f"{i:06d}")


def code(i: int, width: int = 5) -> str:
    """``i`` in base 26, as letters: distinct words for distinct numbers (26**5 of them)."""
    out = ""
    for _ in range(width):
        i, digit = divmod(i, 26)
        out += "abcdefghijklmnopqrstuvwxyz"[digit]
    return out


def dense_passage(n: int) -> str:
    """Up to 180 words, a sentence each, each word seven hyphenated terms, cut at 8,192
    characters (the longest passage whose analysis is kept): no two passages share a word."""
    words = (
        "X" + "-".join(code(n * PASSAGE_WORDS + i) + s for s in "abcdefg") + "."
        for i in range(PASSAGE_WORDS)
    )
    return " ".join(words)[:8192]


def astral_text(n: int, chars: int = 65_536) -> str:
    """Words of 63 letters from beyond the Basic Multilingual Plane, a space before each, up
    to ``chars``: each a piece of the token counter and a word of compression, no two alike
    (the first two letters say which word it is)."""
    words = []
    for i in range(chars // 64):
        which = n * (chars // 64) + i
        head = chr(0x20000 + which // 42_000) + chr(0x20000 + which % 42_000)
        words.append(" " + head + "".join(chr(0x20000 + (which + j) % 42_000) for j in range(61)))
    return "".join(words)


def held(
    run: Callable[[], Any], look: Callable[[], tuple[int, int]], empty: Callable[[], None]
) -> tuple[float, float, tuple[int, int]]:
    """(MB a memo holds after ``run``, seconds ``run`` took, what ``look`` says it keeps: its
    entries and their weight): traced bytes after ``run``, less those left once ``empty``
    emptied the memo."""
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    looked = look()
    empty()
    gc.collect()
    emptied = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - emptied) / 2**20, seconds, looked


def resident_mb() -> float:
    """This process's resident memory, after glibc gave back what is free (freed C++ and Rust
    memory would otherwise still count)."""
    import ctypes
    import os

    from bench.replica_memory import rss_mb

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mb(os.getpid())


def twice(use: Callable[[], Any]) -> tuple[float, float]:
    """A use's time the first time and the second (ms)."""
    times = []
    for _ in range(2):
        started = time.perf_counter()
        use()
        times.append((time.perf_counter() - started) * 1000)
    return times[0], times[1]


def injection_blob(within_tokens: int = 3_900) -> str:
    """The repository's attack texts, each added if it makes more rule signals fire and the
    whole stays within ``within_tokens`` (approximate)."""
    from pipeline.guards.injection import rule_signals
    from pipeline.model.tokens import ApproximateTokenCounter

    counter = ApproximateTokenCounter()
    blob, best = "", 0
    for name in INJECTION_TEXTS:
        for line in (ROOT / name).read_text("utf-8").splitlines():
            row = json.loads(line)
            if row.get("label") != "injection":
                continue
            candidate = f"{blob}\n{row['text']}"
            if counter.count(candidate) > within_tokens:
                continue
            signals = len(rule_signals(candidate))
            if signals > best:
                blob, best = candidate, signals
    return blob


def guard_stage(memo: str, entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.context import ChatParams, Principal, RequestContext
    from pipeline.guards.injection import InjectionDetector
    from pipeline.guards.policy import PolicyBook
    from pipeline.model.salt import MemoScope
    from pipeline.model.tokens import ApproximateTokenCounter
    from pipeline.stages.guard_in import Blocked, GuardInput

    stage = GuardInput(
        PolicyBook.from_json({}), InjectionDetector(), ApproximateTokenCounter(), MemoScope()
    )
    kept = (stage._pii if memo == "pii" else stage._judged).kept
    if not budget:
        kept.budget = None
    principal = Principal("acme", "alice", frozenset({"chat"}), "k")
    loop = asyncio.new_event_loop()

    def ask(text: str) -> None:
        ctx = RequestContext(
            params=ChatParams(model="m", messages=[{"role": "user", "content": text}]),
            credential=None,
            deadline=loop.time() + 60,
            principal=principal,
        )
        with contextlib.suppress(Blocked):  # refused, and its verdict kept
            loop.run_until_complete(stage(ctx))

    if memo == "pii":
        texts: Iterable[str] = (
            " ".join(f"{letters(n)}{letters(i)}@x.io" for i in range(ADDRESSES))
            for n in range(entries)
        )
    else:
        blob = injection_blob()
        texts = (f"{letters(n)}\n{blob}" for n in range(entries))
    ask("warm up: mail bob@example.org")
    mb, seconds, (count, weight) = held(
        lambda: [ask(t) for t in texts], lambda: (len(kept), kept.weight), kept.clear
    )
    first, again = twice(lambda: ask("Please write to carol@example.com about the results."))
    loop.close()
    return _row(kept.budget, entries, mb, seconds, first, again, count, weight)


def passages(entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.answer import citations
    from pipeline.model.tokens import ApproximateTokenCounter
    from pipeline.sources import compress

    counter = ApproximateTokenCounter()
    caches = (compress._analyse, citations._analyse)
    if not budget:
        for cache in caches:
            cache.kept.budget = None

    def analyse(text: str) -> None:
        compress._analyse("bench", counter, text)
        citations._analyse("bench", text)

    texts = [dense_passage(n) for n in range(entries)]

    def empty() -> None:
        for cache in caches:
            cache.cache_clear()

    kept = compress._analyse.kept
    mb, seconds, (count, weight) = held(
        lambda: [analyse(t) for t in texts], lambda: (len(kept), kept.weight), empty
    )
    ordinary = "The Moon pulls the tides. " * 46  # ~1,200 characters, an ordinary chunk
    first, again = twice(lambda: analyse(ordinary))
    return _row(kept.budget, entries, mb, seconds, first, again, count, weight)


def pieces(entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.model import tokens

    counter = tokens.load_token_counter()
    assert isinstance(counter, tokens.ModelTokenCounter), "make model: the tokenizer file"
    if not budget:
        counter.pieces.chars = 1 << 62
    texts = [astral_text(n) for n in range(min(entries, 195))]  # 200,000 pieces at most

    def empty() -> None:
        counter.pieces.clear()

    def look() -> tuple[int, int]:
        kept = counter.kept_pieces(None)
        return len(kept), sum(map(len, kept))

    mb, seconds, (count, weight) = held(lambda: [counter.count(t) for t in texts], look, empty)
    first, again = twice(lambda: counter.count("What pulls the tides twice a day?"))
    limit = counter.pieces.chars if budget else None
    return _row(limit, len(texts), mb, seconds, first, again, count, weight)


def stems(entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.sources import compress

    if not budget:
        compress.STEMS.chars = 1 << 62
    texts = [astral_text(n) for n in range(min(entries, 195))]  # 200,000 words at most

    def look() -> tuple[int, int]:
        kept = compress.STEMS.kept("bench")
        return len(kept), sum(len(w) + len(s) for w, s in kept.items())

    mb, seconds, (count, weight) = held(
        lambda: [compress.word_stems("bench", t) for t in texts], look, compress.STEMS.clear
    )
    first, again = twice(
        lambda: compress.word_stems("bench", "The Moon pulls the tides twice a day.")
    )
    limit = compress.STEMS.chars if budget else None
    return _row(limit, len(texts), mb, seconds, first, again, count, weight)


def patterns(entries: int, budget: bool) -> dict[str, Any]:
    import re2

    from pipeline.guards.linear import _options
    from pipeline.tools.schema_check import SchemaLimits, SchemaRefused, check_patterns

    limits = SchemaLimits()
    sent = [f"x{n}\\pL{{400}}" for n in range(min(entries, 128))]

    def before(pattern: str) -> None:
        re2.compile(pattern, _options())  # what check_patterns did: RE2's defaults, cached

    def now(pattern: str) -> None:
        with contextlib.suppress(SchemaRefused):
            check_patterns([pattern], limits, "tools.0.function.parameters", scope="a")

    use = now if budget else before
    start = resident_mb()
    started = time.perf_counter()
    for pattern in sent:
        use(pattern)
    seconds = time.perf_counter() - started
    grown = resident_mb() - start
    kept = re2._Regexp._make.cache_info().currsize
    first, again = twice(lambda: use("^id-[0-9]{6}$"))
    limit = limits.max_pattern_memory if budget else None
    return _row(limit, len(sent), grown, seconds, first, again, kept, 0)


def bpe(entries: int, budget: bool) -> dict[str, Any]:
    import random

    from bench.retrieval_data import load_corpus
    from pipeline.model import tokens

    counter = tokens.load_token_counter()
    assert isinstance(counter, tokens.ModelTokenCounter), "make model: the tokenizer file"
    if not budget:
        counter.tokenizer.model._resize_cache(10_000)  # the library's default
    counter.count("warm up")
    draw = random.Random(7)
    marks = "!#$%&()*+,-./:;<=>?@[\\]^_`{|}~"
    texts = [
        " ".join("".join(draw.choice(marks) for _ in range(250)) for _ in range(261))
        for _ in range(entries)
    ]
    start = resident_mb()
    started = time.perf_counter()
    for text in texts:
        counter.count(text)
    seconds = time.perf_counter() - started
    grown = resident_mb() - start
    abstracts = [document.text for document in load_corpus()[:500]]
    fresh = tokens.load_token_counter()
    if not budget:
        fresh.tokenizer.model._resize_cache(10_000)
    first, again = twice(lambda: [fresh.count(a) for a in abstracts])
    return _row(0 if budget else None, entries, grown, seconds, first, again, 0, 0)


def _row(
    budget: int | None,
    entries: int,
    mb: float,
    seconds: float,
    first: float,
    again: float,
    kept: int,
    weight: int,
) -> dict[str, Any]:
    return {
        "budget": budget,
        "entries": entries,
        "held_mb": round(mb, 1),
        "kept": kept,
        "kept_weight": weight,
        "ms_each": round(seconds * 1000 / entries, 2),
        "seen_first_ms": round(first, 3),
        "seen_again_ms": round(again, 3),
    }


MEMOS: dict[str, Callable[[int, bool], dict[str, Any]]] = {
    "pii": lambda entries, budget: guard_stage("pii", entries, budget),
    "injection": lambda entries, budget: guard_stage("injection", entries, budget),
    "passages": passages,
    "pieces": pieces,
    "stems": stems,
    "patterns": patterns,
    "bpe": bpe,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memos", nargs="+", default=list(MEMOS), choices=list(MEMOS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memo, which = args.child.split(":")
        print(json.dumps(MEMOS[memo](args.entries, which == "budget")))
        return
    for memo in args.memos:
        rows: dict[str, list[dict[str, Any]]] = {"none": [], "budget": []}
        for _ in range(args.rounds):
            for which in ("none", "budget"):  # alternating, each in a fresh process
                child = ["--child", f"{memo}:{which}", "--entries", str(args.entries)]
                done = subprocess.run(
                    [sys.executable, "-m", "bench.memo_memory", *child],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows[which].append(json.loads(done.stdout.splitlines()[-1]))
                print(memo, which, done.stdout.splitlines()[-1], flush=True)
        mb = {w: statistics.median(r["held_mb"] for r in runs) for w, runs in rows.items()}
        each = {w: statistics.median(r["ms_each"] for r in runs) for w, runs in rows.items()}
        print(
            f"{memo}: held (median of {args.rounds}) {mb['none']:.1f} MB without the budget, "
            f"{mb['budget']:.1f} MB with it ({mb['budget'] / max(mb['none'], 0.1):.2f}x); "
            f"time each {each['budget'] / each['none']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
