"""Prefix reuse across questions: time to first token of a second, different question over the
same sources, with the prompt's layout of today (``pipeline.model.prompt``: sources in canonical
order, the personal line after them) against the layout before it (sources in rank order, the
personal line before them), alternating A/B in one run against the real vLLM, prefix cache on.

Each trial takes sources that no earlier request sent (``--top-k`` SciFact abstracts of their own,
different for each layout, so neither finds the other's blocks cached), then, per layout:

1. a first question (a SciFact test query), the sources in one rank order: it fills the cache;
2. a second, different question over the same sources ranked differently (rotated by one, as a
   different question ranks the same passages differently), asked by a user with a personal line
   (``--personal``, the default) or without one (``--no-personal``): its TTFT is the figure.

The prompts go straight to vLLM (the service only ever lays prompts out one way), streamed, and
TTFT is the time to the first content chunk. Which layout goes first alternates by trial.

    RAG_TEST_VLLM_URL=http://127.0.0.1:8001 .venv/bin/python -m bench.prefix_bench [--trials 8]
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
from typing import Any

import httpx

from bench.retrieval_data import load_qrels, load_queries
from pipeline.context import Features, Passage
from pipeline.model.prompt import INSTRUCTIONS, build_messages, personalisation, render_source
from tests.support.data import open_scifact

Layout = Callable[[list[dict[str, Any]], Sequence[Passage], str], list[dict[str, Any]]]
PERSONAL = personalisation(Features({"language": "en", "tier": "pro"}))


def previous_layout(
    messages: list[dict[str, Any]], passages: Sequence[Passage], personal: str
) -> list[dict[str, Any]]:
    """The layout of PROMPT_VERSION 2: instructions, the personal line, sources as ranked."""
    sections = [INSTRUCTIONS]
    if personal:
        sections.append(f"About the user: {personal}")
    sections.append("Sources:\n\n" + "\n\n".join(render_source(p) for p in passages))
    return [{"role": "system", "content": "\n\n".join(sections)}, *messages]


def current_layout(
    messages: list[dict[str, Any]], passages: Sequence[Passage], personal: str
) -> list[dict[str, Any]]:
    return build_messages(messages, passages, personal=personal)


LAYOUTS: dict[str, Layout] = {
    "ranked, personal first": previous_layout,
    "canonical": current_layout,
}


def abstracts(count: int, first: int = 0) -> list[Passage]:
    with open_scifact("corpus.jsonl") as f:
        rows = [json.loads(line) for line in itertools.islice(f, first, first + count)]
    # Ids as the service's chunks are named; scores as a first question might rank them.
    return [
        Passage(r["_id"], f"{r['_id']}#0", r["title"], r["text"], score=1.0 - i / count)
        for i, r in enumerate(rows)
    ]


async def first_token(client: httpx.AsyncClient, model: str, messages: list[Any]) -> float:
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - started
    return time.perf_counter() - started


async def run(
    url: str, model: str, trials: int, top_k: int, personal: bool, first: int = 0
) -> dict[str, Any]:
    queries, qrels = load_queries(), load_qrels("test")
    questions = [queries[q] for q in sorted(qrels, key=int)]
    sources = abstracts(trials * len(LAYOUTS) * top_k + top_k, first)
    first: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    second: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        # Warm-up on sources no trial uses: the engine's first request is slow for other reasons.
        warm = sources[-top_k:]
        await first_token(client, model, current_layout([_ask("warm up")], warm, ""))
        for trial in range(trials):
            order = list(LAYOUTS) if trial % 2 == 0 else list(reversed(LAYOUTS))
            for position, name in enumerate(order):
                start = (trial * len(LAYOUTS) + position) * top_k
                ranked = sources[start : start + top_k]
                rotated = ranked[1:] + ranked[:1]  # the second question's rank order
                q1, q2 = questions[2 * trial], questions[2 * trial + 1]
                layout = LAYOUTS[name]
                line = PERSONAL if personal else ""
                first[name].append(await first_token(client, model, layout([_ask(q1)], ranked, "")))
                second[name].append(
                    await first_token(client, model, layout([_ask(q2)], rotated, line))
                )
    old, new = (second[name] for name in LAYOUTS)
    return {
        "trials": trials,
        "top_k": top_k,
        "personal": personal,
        "first_p50": {n: statistics.median(v) for n, v in first.items()},
        "second_p50": {n: statistics.median(v) for n, v in second.items()},
        "ratio_p50": statistics.median(b / a for a, b in zip(old, new, strict=True)),
    }


def _ask(question: str) -> dict[str, str]:
    return {"role": "user", "content": question}


def report(result: dict[str, Any]) -> None:
    who = "a user with a personal line" if result["personal"] else "a user without a personal line"
    print(
        f"{result['trials']} trials, top_k {result['top_k']} SciFact abstracts; the second "
        f"question from {who}\n"
    )
    print("| layout | first question TTFT p50 (s) | second question TTFT p50 (s) |")
    print("| --- | --- | --- |")
    for name in LAYOUTS:
        print(f"| {name} | {result['first_p50'][name]:.3f} | {result['second_p50'][name]:.3f} |")
    print(f"\nsecond question, canonical / ranked (median of pairs): **{result['ratio_p50']:.2f}**")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--personal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--first-document",
        type=int,
        default=0,
        help="where in the corpus the sources start (another run on the same vLLM: skip the "
        "abstracts it sent, or they are cached)",
    )
    args = parser.parse_args()
    url = os.environ.get("RAG_TEST_VLLM_URL", "http://127.0.0.1:8001")
    result = run(url, args.model, args.trials, args.top_k, args.personal, args.first_document)
    report(asyncio.run(result))


if __name__ == "__main__":
    main()
