"""What the request path's memos hold after texts a hostile or careless caller makes, with
their weight budgets (``pipeline.kept``) and without them (the memos before: 4,096 entries,
whatever each holds).

    .venv/bin/python -m bench.memo_memory [--entries 4096] [--rounds 1]

Each row runs in a process of its own, the two configurations alternating:

- ``pii``: the ``guard_in`` stage with the default policy (PII redacted, at most 4,096 input
  tokens) given ``--entries`` distinct chat requests, each one user message of as many e-mail
  addresses as its tokens allow (one chat key can send them). The budget:
  ``MEMO_FINDINGS`` findings.
- ``passages``: compression's and citations' per-passage analyses given ``--entries`` distinct
  passages as long as is kept (8,192 characters) and as dense as the chunker lets a passage be
  (up to 180 words, a sentence each, each word seven hyphenated terms): a tenant with an
  ingest key can store such chunks, and every chat request that retrieves them has them
  analysed. The budget: ``KEPT_TEXT_CHARS`` characters.

VmRSS is read before and after (the stemmers' own bounded caches filled first, so they are not
counted), with what the memos keep. Then a text seen again (an everyday question; a passage)
shows the memo still answers it: its second use against its first.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.replica_memory import rss_mb

ADDRESSES = 580  # 7 approximate tokens each: 4,060 of the default 4,096
PASSAGE_WORDS = 180  # retrieval.documents.DEFAULT_MAX_WORDS


def letters(i: int) -> str:
    """``i``'s six decimal digits as letters a to j."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[int(d)] for d in f"{i:06d}")


async def pii(entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.context import ChatParams, Principal, RequestContext
    from pipeline.guards.injection import InjectionDetector
    from pipeline.guards.policy import PolicyBook
    from pipeline.model.tokens import ApproximateTokenCounter
    from pipeline.stages.guard_in import GuardInput

    stage = GuardInput(PolicyBook.from_json({}), InjectionDetector(), ApproximateTokenCounter())
    if not budget:
        stage._pii.kept.budget = None
    principal = Principal("acme", "alice", frozenset({"chat"}), "k")
    loop = asyncio.get_running_loop()

    async def ask(text: str) -> float:
        ctx = RequestContext(
            params=ChatParams(model="m", messages=[{"role": "user", "content": text}]),
            credential=None,
            deadline=loop.time() + 60,
            principal=principal,
        )
        started = time.perf_counter()
        await stage(ctx)
        return (time.perf_counter() - started) * 1000

    await ask("warm up: mail bob@example.org")
    gc.collect()
    before = rss_mb(os.getpid())
    started = time.perf_counter()
    for n in range(entries):
        # "abcdef" + "abcdef": 12 letters, 3 approximate tokens; "@x.io" 4 more.
        await ask(" ".join(f"{letters(n)}{letters(i)}@x.io" for i in range(ADDRESSES)))
    seconds = time.perf_counter() - started
    gc.collect()
    after = rss_mb(os.getpid())
    question = "Please write to carol@example.com about the 2024 results."
    first, again = await ask(question), await ask(question)
    kept = stage._pii.kept
    return _row(kept.budget, entries, before, after, seconds, first, again, len(kept), kept.weight)


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


def passages(entries: int, budget: bool) -> dict[str, Any]:
    from pipeline.answer import citations
    from pipeline.model.tokens import ApproximateTokenCounter
    from pipeline.sources import compress

    counter = ApproximateTokenCounter()
    caches = (compress._analyse, citations._analyse)
    if not budget:
        for cache in caches:
            cache.kept.budget = None

    def analyse(text: str) -> float:
        started = time.perf_counter()
        compress._analyse(counter, text)
        citations._analyse(text)
        return (time.perf_counter() - started) * 1000

    texts = [dense_passage(n) for n in range(entries)]
    for text in texts[:600]:  # the stemmers' own caches (bounded) filled before RSS is read
        analyse(text)
    for cache in caches:
        cache.cache_clear()
    gc.collect()
    before = rss_mb(os.getpid())
    started = time.perf_counter()
    for text in texts:
        analyse(text)
    seconds = time.perf_counter() - started
    gc.collect()
    after = rss_mb(os.getpid())
    ordinary = "The Moon pulls the tides. " * 46  # ~1,200 characters, an ordinary chunk
    first, again = analyse(ordinary), analyse(ordinary)
    kept = compress._analyse.kept
    return _row(kept.budget, entries, before, after, seconds, first, again, len(kept), kept.weight)


def _row(
    budget: int | None,
    entries: int,
    before: float,
    after: float,
    seconds: float,
    first: float,
    again: float,
    kept: int,
    weight: int,
) -> dict[str, Any]:
    return {
        "budget": budget,
        "entries": entries,
        "rss_before_mb": round(before, 1),
        "rss_after_mb": round(after, 1),
        "grew_mb": round(after - before, 1),
        "kept": kept,
        "kept_weight": weight,
        "ms_each": round(seconds * 1000 / entries, 2),
        "seen_first_ms": round(first, 3),
        "seen_again_ms": round(again, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memos", nargs="+", default=["pii", "passages"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memo, which = args.child.split(":")
        row = (
            asyncio.run(pii(args.entries, which == "budget"))
            if memo == "pii"
            else passages(args.entries, which == "budget")
        )
        print(json.dumps(row))
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
        grew = {w: statistics.median(r["grew_mb"] for r in runs) for w, runs in rows.items()}
        each = {w: statistics.median(r["ms_each"] for r in runs) for w, runs in rows.items()}
        print(
            f"{memo}: RSS growth (median of {args.rounds}) {grew['none']:.1f} MB without the "
            f"budget, {grew['budget']:.1f} MB with it ({grew['budget'] / grew['none']:.2f}x); "
            f"time each {each['budget'] / each['none']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
