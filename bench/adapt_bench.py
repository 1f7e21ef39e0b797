"""Graceful under load: p95 time to first token at twice the load that saturates vLLM, with and
without adaptation (``pipeline.routing.load``), in one run, and what the reduced top_k and
compression budget cost in retrieval quality on SciFact.

Part ``load`` (against the real vLLM, ``RAG_TEST_VLLM_URL`` or one this run starts):

1. Saturation: streamed questions through the service (adaptation off, no route bound in the
   way) at concurrency 1, 2, 4, ...: the first concurrency whose TTFT p50 is at least
   ``--climb`` times that at 1 is where vLLM saturates (``c*``).
2. Two services side by side, the same index, one route bounded at ``c*`` concurrent calls (what
   an operator sets for a server that sustains ``c*``): adaptation on and off. Rounds of ``2 c*``
   concurrent questions go to one, then the other (which goes first alternates), each question
   a miss (``Cache-Control: no-cache, no-store``), at the default top_k and compression.

One route only: locally every route is the same vLLM, so the ``small_route`` step would only
add a second route's slots to the same server (tests/app/test_adapt_under_load.py proves it).

Part ``quality`` (no vLLM): SciFact test, each query's cascade results as the retrieve stage
hands them over: nDCG@10 of the sources at the default top_k against the reduced one, and the
share of retrieved relevant documents that reach the prompt after compression at the default
budget against the reduced one.

    RAG_TEST_VLLM_URL=http://127.0.0.1:8001 .venv/bin/python -m bench.adapt_bench [--rounds 4]
    .venv/bin/python -m bench.adapt_bench --part quality
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from typing import Any

import httpx
import numpy as np

from app.main import create_app
from app.settings import AdaptSettings, CompressSettings, RetrievalSettings, Settings
from bench.retrieval_data import load_corpus, load_qrels, load_queries, ndcg_at_k
from tests.support.servers import LiveService, RedisServer, VLLMServer

TENANT = "adapt"
HEADERS = {"Cache-Control": "no-cache, no-store"}


async def first_token(client: httpx.AsyncClient, key: str, question: str) -> float:
    """Seconds to the first content chunk of a streamed answer (a refusal: NaN)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    headers = {**HEADERS, "Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return float("nan")
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - started
    return time.perf_counter() - started


async def burst(client: httpx.AsyncClient, key: str, questions: list[str]) -> list[float]:
    return list(await asyncio.gather(*(first_token(client, key, q) for q in questions)))


def percentile(values: list[float], share: float) -> float:
    return float(np.percentile(np.array(values), share))


def settings_for(redis_url: str, llm_url: str, *, adapt: bool, bound: int | None) -> Settings:
    route: dict[str, Any] = {"base_url": llm_url, "model": "smollm2"}
    if bound is not None:
        route |= {"max_concurrency": bound, "max_tenant_concurrency": bound}
    return Settings(
        environment="test",
        redis={"url": redis_url, "key_prefix": f"adapt{int(adapt)}{bound}:"},
        llm={"base_url": llm_url},
        retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-bench-adapt-")},
        routing={"routes": {"small": route}},
        adapt={"enabled": adapt},
        jobs={"workers": 0},
    )


def scifact_subset(count: int, extra: int) -> tuple[list[str], list[Any]]:
    queries, qrels = load_queries(), load_qrels("test")
    chosen = sorted(qrels, key=int)[:count]
    relevant = {d for q in chosen for d in qrels[q]}
    corpus = load_corpus()
    rest = [d for d in corpus if d.id not in relevant]
    random.Random(7).shuffle(rest)
    documents = [d for d in corpus if d.id in relevant] + rest[:extra]
    return [queries[q] for q in chosen], documents


class Service:
    """One app served on its own port, with the SciFact subset ingested and a key."""

    def __init__(self, settings: Settings, documents: list[Any]) -> None:
        self.app = create_app(settings)
        self.live = LiveService(self.app)
        self.documents = documents
        self.key = ""

    def __enter__(self) -> Service:
        self.live.__enter__()
        services = self.app.state.services
        ingest = services.retrieval.ingest(TENANT, self.documents)
        asyncio.run_coroutine_threadsafe(ingest, self.live.server_loop).result(900)
        self.key = self.live.run(services.keys.create(TENANT, "u", frozenset({"chat"})))
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)


async def saturation(
    service: Service, questions: list[str], levels: list[int], climb: float
) -> tuple[int, dict[int, float]]:
    p50: dict[int, float] = {}
    async with httpx.AsyncClient(base_url=service.live.url, timeout=300) as client:
        await first_token(client, service.key, "Warm-up: what is a cell?")
        for level in levels:
            asked = [questions[(level + i) % len(questions)] for i in range(2 * level)]
            ttfts = []
            for start in range(0, len(asked), level):
                ttfts += await burst(client, service.key, asked[start : start + level])
            p50[level] = statistics.median(ttfts)
            if p50[level] >= climb * p50[levels[0]]:
                return level, p50
    return levels[-1], p50


async def side_by_side(
    services: dict[str, Service], questions: list[str], load: int, rounds: int
) -> dict[str, list[float]]:
    ttfts: dict[str, list[float]] = {name: [] for name in services}
    clients = {
        name: httpx.AsyncClient(base_url=s.live.url, timeout=300) for name, s in services.items()
    }
    try:
        for name, service in services.items():
            await first_token(clients[name], service.key, "Warm-up: what is a cell?")
        for number in range(rounds):
            order = list(services) if number % 2 == 0 else list(reversed(services))
            asked = [questions[(number * load + i) % len(questions)] for i in range(load)]
            for name in order:
                ttfts[name] += await burst(clients[name], services[name].key, asked)
    finally:
        for client in clients.values():
            await client.aclose()
    return ttfts


def load_part(args: argparse.Namespace) -> None:
    redis, vllm = RedisServer(), VLLMServer()
    redis.start()
    vllm.start()
    questions, documents = scifact_subset(args.queries, args.extra_documents)
    levels = [int(x) for x in args.levels.split(",")]
    try:
        probe = settings_for(redis.url, vllm.url, adapt=False, bound=None)
        with Service(probe, documents) as service:
            found, sweep = asyncio.run(saturation(service, questions, levels, args.climb))
        load = 2 * found
        sides = {
            "adaptation on": Service(
                settings_for(redis.url, vllm.url, adapt=True, bound=found), documents
            ),
            "adaptation off": Service(
                settings_for(redis.url, vllm.url, adapt=False, bound=found), documents
            ),
        }
        with sides["adaptation on"], sides["adaptation off"]:
            ttfts = asyncio.run(side_by_side(sides, questions, load, args.rounds))
    finally:
        vllm.stop()
        redis.stop()
    print(f"{len(questions)} SciFact test questions, {len(documents)} abstracts indexed\n")
    print("| concurrency | TTFT p50 (s) |")
    print("| --- | --- |")
    for level, value in sweep.items():
        print(f"| {level} | {value:.3f} |")
    print(f"\nsaturation c* = {found} (TTFT p50 >= {args.climb}x that at 1); load {load}\n")
    print("| service (route bound c*) | requests | refused | TTFT p50 (s) | TTFT p95 (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in ttfts.items():
        answered = [v for v in values if v == v]
        print(
            f"| {name} | {len(values)} | {len(values) - len(answered)} | "
            f"{statistics.median(answered):.3f} | {percentile(answered, 95):.3f} |"
        )
    on, off = ([v for v in ttfts[n] if v == v] for n in ("adaptation on", "adaptation off"))
    print(f"\np95 on/off: **{percentile(on, 95) / percentile(off, 95):.2f}**, ", end="")
    print(f"p50 on/off: **{statistics.median(on) / statistics.median(off):.2f}**")


def quality_part(args: argparse.Namespace) -> None:
    from bench.compress_bench import passages_for
    from bench.retrieval_data import load_split
    from pipeline.model.tokens import load_token_counter
    from pipeline.sources.compress import compress
    from retrieval.tokenize import tokenize

    split = load_split("test")
    counter = load_token_counter()
    default, reduced = RetrievalSettings().top_k, AdaptSettings().top_k
    budgets = CompressSettings().budget_tokens, AdaptSettings().budget_tokens
    rows = passages_for(split, default)
    ndcg = {default: 0.0, reduced: 0.0}
    reached = {default: 0, reduced: 0}
    relevant_total = 0
    tokens = {default: 0, reduced: 0}
    for qid, query, passages in rows:
        qrels = split.qrels[qid]
        relevant_total += sum(1 for r in qrels.values() if r > 0)
        idf = split.index.bm25.idf_of(tokenize(query))
        for top_k, budget in zip((default, reduced), budgets, strict=True):
            shown = passages[:top_k]
            ndcg[top_k] += ndcg_at_k([p.document_id for p in shown], qrels)
            done = compress(
                query, shown, budget_tokens=budget, counter=counter, idf=idf, scope="bench"
            )
            reached[top_k] += sum(
                1 for d in {p.document_id for p in done.passages} if qrels.get(d, 0) > 0
            )
            tokens[top_k] += done.tokens_after
    n = len(rows)
    print(f"SciFact test, {n} queries (cascade results as the retrieve stage hands them over)\n")
    print("| sources | nDCG@10 | relevant documents in the prompt | source tokens, mean |")
    print("| --- | --- | --- | --- |")
    for top_k, budget in zip((default, reduced), budgets, strict=True):
        print(
            f"| top_k {top_k}, compressed to {budget} | {ndcg[top_k] / n:.3f} | "
            f"{reached[top_k]}/{relevant_total} = {reached[top_k] / relevant_total:.3f} | "
            f"{tokens[top_k] / n:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["load", "quality"], default="load")
    parser.add_argument("--queries", type=int, default=24)
    parser.add_argument("--extra-documents", type=int, default=150)
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument("--climb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    (load_part if args.part == "load" else quality_part)(args)


if __name__ == "__main__":
    main()
