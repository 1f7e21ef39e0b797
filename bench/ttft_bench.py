"""Time to first token through the service, against the real CPU vLLM, side by side in one run.

1. Compression off and on, for the same SciFact test questions and the same retrieved passages
   (the relevance gate as configured; the request's ``rag.compress`` toggled): the prompt
   tokens vLLM reports (usage) and the time to the first content chunk at the client. Once at
   the service's defaults (top_k 4) and once at top_k 8 (as in ``bench.compress_bench``; the
   uncompressed prompt then needs vLLM's ``--max-model-len`` above 2,048: the run starts its own
   vLLM with 4,096 unless ``RAG_TEST_VLLM_URL`` names one).
2. The prefix cache, on questions not asked before in the run (so nothing after the fixed
   instructions is cached): the first user, then a second user asking the same (a different
   user, so the response cache cannot answer; the same prompt, so vLLM's prefix cache can), then
   a third user with a personalisation line, who shares only the fixed instructions (our layout
   puts the user's line before the sources).

Order alternates between pairs, so neither side always finds vLLM's cache warmer.

    .venv/bin/python -m bench.ttft_bench [--queries 24] [--prefix-queries 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from typing import Any

import httpx

from app.main import create_app
from app.settings import Settings
from bench.retrieval_data import load_corpus, load_qrels, load_queries
from pipeline.features.store import FeatureRow
from tests.support.servers import LiveService, RedisServer, VLLMServer

TENANT = "ttft"


async def first_token(
    client: httpx.AsyncClient, key: str, question: str, **rag: Any
) -> tuple[float, int]:
    """Seconds to the first content chunk, and the prompt tokens vLLM counted."""
    request = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "rag": rag,
    }
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}
    started = time.perf_counter()
    ttft = None
    prompt_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=request, headers=headers) as r:
        async for line in r.aiter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - started
            if '"prompt_tokens"' in line and '"choices":[]' in line:
                prompt_tokens = int(line.split('"prompt_tokens":')[1].split(",")[0])
    return (ttft if ttft is not None else time.perf_counter() - started), prompt_tokens


def questions(count: int) -> list[tuple[str, list[str]]]:
    queries, qrels = load_queries(), load_qrels("test")
    chosen = sorted(qrels)[:count]
    return [(queries[q], sorted(qrels[q])) for q in chosen]


def corpus_for(asked: list[tuple[str, list[str]]], extra: int) -> list[Any]:
    corpus = load_corpus()
    relevant = {d for _, docs in asked for d in docs}
    rest = [d for d in corpus if d.id not in relevant]
    random.Random(7).shuffle(rest)
    return [d for d in corpus if d.id in relevant] + rest[:extra]


async def compression(
    client: httpx.AsyncClient, key: str, asked: list[Any], **rag: Any
) -> dict[str, Any]:
    off: list[tuple[float, int]] = []
    on: list[tuple[float, int]] = []
    for number, (question, _) in enumerate(asked):
        pair = [("off", False), ("on", True)]
        if number % 2:
            pair.reverse()
        for name, flag in pair:
            result = await first_token(client, key, question, compress=flag, **rag)
            (on if name == "on" else off).append(result)
    kept = [(a, b) for a, b in zip(off, on, strict=True) if a[1] and b[1]]
    return {
        "pairs": len(kept),
        "tokens_off": statistics.median(a[1] for a, _ in kept),
        "tokens_on": statistics.median(b[1] for _, b in kept),
        "ttft_off": statistics.median(a[0] for a, _ in kept),
        "ttft_on": statistics.median(b[0] for _, b in kept),
        "ttft_ratio": statistics.median(b[0] / a[0] for a, b in kept),
    }


async def prefix_cache(
    client: httpx.AsyncClient, keys: dict[str, str], asked: list[Any]
) -> dict[str, float]:
    first: list[float] = []
    second: list[float] = []
    personal: list[float] = []
    for question, _ in asked:
        marked = f"{question} (asked at {time.time_ns()})"  # a prompt vLLM has not seen
        first.append((await first_token(client, keys["ann"], marked))[0])
        second.append((await first_token(client, keys["bob"], marked))[0])
        personal.append((await first_token(client, keys["pia"], marked))[0])
    return {
        "first": statistics.median(first),
        "second": statistics.median(second),
        "personal": statistics.median(personal),
        "second_ratio": statistics.median(b / a for a, b in zip(first, second, strict=True)),
        "personal_ratio": statistics.median(c / a for a, c in zip(first, personal, strict=True)),
    }


async def run(live: LiveService, app: Any, count: int, fresh_count: int, extra: int) -> None:
    services = app.state.services
    everything = questions(count + fresh_count)
    asked, fresh = everything[:count], everything[count:]
    documents = corpus_for(everything, extra)
    await asyncio.wrap_future(
        asyncio.run_coroutine_threadsafe(
            services.retrieval.ingest(TENANT, documents), live.server_loop
        )
    )
    keys = {
        user: live.run(services.keys.create(TENANT, user, frozenset({"chat"})))
        for user in ("ann", "bob", "pia")
    }
    pia = FeatureRow(TENANT, "pia", {"language": "pt", "tier": "pro"})
    live.run(services.features.write_many([pia]))
    async with httpx.AsyncClient(base_url=live.url, timeout=300) as client:
        await first_token(client, keys["ann"], "Warm-up: what is a cell?")
        squeeze = await compression(client, keys["ann"], asked)
        wide = await compression(client, keys["ann"], asked, top_k=8)
        cached = await prefix_cache(client, keys, fresh)
    print(f"{len(asked)} SciFact test questions, {extra} other abstracts indexed beside theirs\n")
    print("| top_k | compression | pairs | prompt tokens (median) | TTFT p50 (s) |")
    print("| --- | --- | --- | --- | --- |")
    for top_k, result in (("4 (default)", squeeze), ("8", wide)):
        for side in ("off", "on"):
            tokens, ttft = result[f"tokens_{side}"], result[f"ttft_{side}"]
            print(f"| {top_k} | {side} | {result['pairs']} | {tokens:.0f} | {ttft:.3f} |")
        ratio = result["tokens_off"] / result["tokens_on"]
        print(
            f"| {top_k} | on/off | | **{ratio:.2f}x fewer** "
            f"| **{result['ttft_ratio']:.2f}** (median of pairs) |"
        )
    print("\n| who asks | TTFT p50 (s) | ratio to the first |")
    print("| --- | --- | --- |")
    print(f"| first user | {cached['first']:.3f} | 1 |")
    second = f"{cached['second']:.3f} | **{cached['second_ratio']:.2f}**"
    print(f"| second user, same question | {second} |")
    print(
        f"| third user, own personal line | {cached['personal']:.3f} "
        f"| **{cached['personal_ratio']:.2f}** |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=24)
    parser.add_argument("--prefix-queries", type=int, default=10)
    parser.add_argument("--extra-documents", type=int, default=500)
    args = parser.parse_args()
    os.environ.setdefault("RAG_VLLM_MAX_LEN", "4096")  # read by a vLLM this run starts
    redis, vllm = RedisServer(), VLLMServer()
    redis.start()
    vllm.start()
    settings = Settings(
        environment="test",
        redis={"url": redis.url},
        llm={"base_url": vllm.url},
        retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-bench-ttft-")},
        jobs={"workers": 0},
    )
    app = create_app(settings)
    try:
        with LiveService(app) as live:
            asyncio.run(run(live, app, args.queries, args.prefix_queries, args.extra_documents))
    finally:
        vllm.stop()
        redis.stop()


if __name__ == "__main__":
    main()
