"""What routing costs per request, and how often it is right.

    .venv/bin/python -m bench.router_bench [--rounds 200]

Decision cost, p50/p99 per request: the rules path (``Router.decide`` settles it), the centroid
path without the embedding (rules, then ``by_vector`` on a vector retrieval already computed)
and with it (the query embedded at batch 1, as when retrieval did not run). The start-up cost
(embedding the example prompts) too. Accuracy on the labelled queries of
``tests/pipeline/data/route_queries.jsonl``: rules and centroids together (the router as it
runs), rules with the length fallback (no embedder), and the centroids alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pipeline.context import ChatParams, Features, RouteChoice
from pipeline.model.client import LLMClient
from pipeline.model.routes import Route, RouteTable
from pipeline.routing.router import Centroids, Router, load_examples
from retrieval import Embedder

LABELLED = Path(__file__).parent.parent / "tests" / "pipeline" / "data" / "route_queries.jsonl"


def params(text: str) -> ChatParams:
    return ChatParams(model="auto", messages=[{"role": "user", "content": text}])


def table() -> RouteTable:
    def route(name: str) -> Route:
        return Route(name, "smollm2", LLMClient("http://127.0.0.1:9"), asyncio.Semaphore(1))

    return RouteTable({"small": route("small"), "large": route("large")}, default="small")


def timed_us(fn: Callable[[], object], rounds: int) -> tuple[list[float], float]:
    """Wall-clock µs of each call, and the mean CPU µs of the process per call (all threads:
    on a shared machine it moves less with other people's load than the wall clock does)."""
    out = []
    cpu_started = time.process_time()
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1e6)
    return out, (time.process_time() - cpu_started) * 1e6 / rounds


def row(label: str, timing: tuple[list[float], float]) -> str:
    us, cpu = timing
    p50 = statistics.median(us)
    p99 = float(np.percentile(us, 99))
    return f"| {label} | {p50:,.1f} | {p99:,.1f} | {cpu:,.1f} | {len(us):,} |"


def accuracy(choices: Sequence[str], expected: Sequence[str]) -> str:
    right = sum(c == e for c, e in zip(choices, expected, strict=True))
    return f"{right}/{len(expected)} ({right / len(expected):.1%})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200, help="passes over the open queries")
    args = parser.parse_args()
    rows = [json.loads(line) for line in LABELLED.read_text("utf-8").splitlines() if line]
    texts = [r["text"] for r in rows]
    expected = [r["route"] for r in rows]

    embedder = Embedder()
    embedder.warm_up()
    embedder.embed(["warm up the first call"])
    started = time.perf_counter()
    centroids = Centroids(load_examples(), embedder.embed)
    centroids.warm_up()
    startup_ms = (time.perf_counter() - started) * 1000.0
    routes = table()
    router = Router(routes, centroids=centroids)
    rules_only = Router(routes)
    vectors = embedder.embed(texts)
    features = Features()

    settled = [t for t in texts if router.decide(params(t), features) is not None]
    open_ = [
        (t, v)
        for t, v in zip(texts, vectors, strict=True)
        if router.decide(params(t), features) is None
    ]

    settled_turns = itertools.cycle(settled)
    open_turns = itertools.cycle(open_)

    def rules_path() -> RouteChoice | None:
        return router.decide(params(next(settled_turns)), features)

    def centroid_path() -> RouteChoice:
        text, vector = next(open_turns)
        return router.decide(params(text), features) or router.by_vector(params(text), vector)

    def centroid_with_embedding() -> RouteChoice:
        text, _ = next(open_turns)
        choice = router.decide(params(text), features)
        return choice or router.by_vector(params(text), embedder.embed([text])[0])

    n_rules = args.rounds * len(settled)
    n_open = args.rounds * len(open_)
    print(
        f"load average {os.getloadavg()[0]:.1f}; {len(settled)} queries settled by rules, "
        f"{len(open_)} left open\n"
    )
    print("| path | p50 µs | p99 µs | CPU µs (mean) | decisions |\n| --- | --- | --- | --- | --- |")
    print(row("rules settle it", timed_us(rules_path, n_rules)))
    print(row("rules, then nearest centroid (vector given)", timed_us(centroid_path, n_open)))
    print(
        row(
            "rules, then embed the query (batch 1) and nearest centroid",
            timed_us(centroid_with_embedding, min(n_open, 300)),
        )
    )
    print(
        f"\nstart-up: {len(centroids.examples)} example prompts embedded in {startup_ms:.0f} ms\n"
    )

    full = [router.choose(params(t), features, v).name for t, v in zip(texts, vectors, strict=True)]
    no_embedder = [rules_only.choose(params(t), features).name for t in texts]
    alone = []
    for vector in vectors:
        scores = centroids.scores(vector)
        alone.append(max(scores, key=lambda intent: scores[intent]))
    print("| router | right on the labelled queries |\n| --- | --- |")
    print(
        f"| rules + nearest centroid (as it runs with retrieval on) | {accuracy(full, expected)} |"
    )
    print(f"| rules + length fallback (no embedder) | {accuracy(no_embedder, expected)} |")
    print(f"| nearest centroid alone | {accuracy(alone, expected)} |")
    misses = [t for t, c, e in zip(texts, full, expected, strict=True) if c != e]
    print("\nmisses (rules + centroid):", *(f"  {t!r}" for t in misses), sep="\n")


if __name__ == "__main__":
    main()
