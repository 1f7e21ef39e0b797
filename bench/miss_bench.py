"""What the pipeline adds to a miss: time to first token through the service against the same
final prompt sent straight to vLLM, alternating, and where the service's part goes, by stage.

    .venv/bin/python -m bench.miss_bench [--questions 20] [--rounds 2] [--quick]
                                         [--llm-url http://127.0.0.1:8001]

The service runs in this process (uvicorn in a thread, its default settings: retrieval, guards,
routing, features, tools; content capture on so the ``chat`` span carries the messages it sent)
over a private redis-server and the real vLLM (``--llm-url``, else ``RAG_TEST_VLLM_URL``, else
port 8001). Its tenant is SciFact: the whole corpus (``--quick``: the questions' abstracts and
300 others), one chunk per abstract, embedded once through the on-disk cache.

Per SciFact test question: one request through the service captures the prompt it sent (and
puts it in vLLM's prefix cache); then ``--rounds`` pairs, service and direct in alternating
order, both on that warm prompt, so the difference is the pipeline's and not prefill's. Each
service request's spans give its breakdown: the HTTP layer, each stage up to ``generate``, the
prompt and route slot, vLLM's first chunk, and the rest to the client. The figure of the issue's
target is the time from the root span's start (the request, before auth) to the upstream call
(the ``chat`` span's start), query embedding included: target p50 <= 15 ms.

Writes bench/results/miss.json (``bench.plots`` draws the stacked bar).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import create_app
from app.settings import Settings
from bench.e2e import (
    NO_CACHE,
    Breakdown,
    StreamConnection,
    breakdown,
    chat_request,
    finished_spans,
    median,
    median_retrieval,
    median_segments,
    median_stages,
    percentile,
    scifact_tenant,
    vllm_url,
    write_result,
)
from bench.ttft_bench import questions
from tests.support.servers import LiveService, RedisServer

TENANT = "scifact"
TARGET_MS = 15.0


def service_settings(redis_url: str, llm_url: str, index_dir: Path, **overrides: Any) -> Settings:
    """The service's defaults, on this run's Redis, vLLM and index, with the chat span's
    content captured (the prompt the service sent is what the direct request sends)."""
    options: dict[str, Any] = {
        "environment": "test",
        "redis": {"url": redis_url},
        "llm": {"base_url": llm_url},
        "retrieval": {"index_dir": str(index_dir)},
        "jobs": {"workers": 0},
        "telemetry": {"capture_content": True},
        "log": {"requests": False},
    }
    for group, values in overrides.items():
        options[group] = (
            {**options.get(group, {}), **values} if isinstance(values, dict) else values
        )
    return Settings(**options)


class Pair:
    """One question's figures: the service's and the direct TTFTs and the service's spans."""

    def __init__(self) -> None:
        self.service: list[float] = []
        self.direct: list[float] = []
        self.breakdowns: list[Breakdown] = []


async def measure(
    live: LiveService,
    exporter: InMemorySpanExporter,
    key: str,
    llm: str,
    asked: list[tuple[str, list[str]]],
    rounds: int,
    max_tokens: int,
) -> dict[str, Any]:
    service = StreamConnection(live.url, {"Authorization": f"Bearer {key}", **NO_CACHE})
    direct = StreamConnection(llm)
    cold: list[Breakdown] = []
    cold_ttft: list[float] = []
    pairs: list[Pair] = []

    async def through_service(question: str) -> tuple[float, Breakdown]:
        answer = await service.send(
            chat_request([{"role": "user", "content": question}], max_tokens)
        )
        if not answer.ok or answer.ttft_s is None:
            raise RuntimeError(f"service: {answer.status} {answer.body[:300]!r}")
        spans = await finished_spans(exporter, answer.trace_id)
        return answer.ttft_s, breakdown(spans, answer.ttft_s)

    try:
        await through_service("Warm-up: what does vitamin D do?")
        for number, (question, _) in enumerate(asked):
            ttft, first = await through_service(question)
            cold.append(first)
            cold_ttft.append(ttft)
            if first.prompt is None:
                raise RuntimeError("the chat span carried no messages: content capture is off")
            prompt = chat_request(first.prompt, max_tokens)
            pair = Pair()
            for repeat in range(rounds):
                for side in ("service", "direct")[:: 1 if (number + repeat) % 2 == 0 else -1]:
                    if side == "service":
                        ttft, spans = await through_service(question)
                        pair.service.append(ttft)
                        pair.breakdowns.append(spans)
                    else:
                        answer = await direct.send(prompt)
                        if not answer.ok or answer.ttft_s is None:
                            raise RuntimeError(f"vLLM: {answer.status} {answer.body[:300]!r}")
                        pair.direct.append(answer.ttft_s)
            pairs.append(pair)
            exporter.clear()
    finally:
        service.close()
        direct.close()
    return summarise(pairs, cold, cold_ttft)


def summarise(pairs: list[Pair], cold: list[Breakdown], cold_ttft: list[float]) -> dict[str, Any]:
    service = [t for p in pairs for t in p.service]
    direct = [t for p in pairs for t in p.direct]
    warm = [b for p in pairs for b in p.breakdowns]
    upstream = [b.upstream_at_ms for b in warm]
    overhead = [(s - d) * 1000.0 for p in pairs for s, d in zip(p.service, p.direct, strict=True)]
    ratios = [s / d for p in pairs for s, d in zip(p.service, p.direct, strict=True)]
    return {
        "questions": len(pairs),
        "pairs": len(overhead),
        "ttft_ms": {
            "service_p50": median(service) * 1000.0,
            "direct_p50": median(direct) * 1000.0,
            "service_p90": percentile(service, 0.9) * 1000.0,
            "direct_p90": percentile(direct, 0.9) * 1000.0,
            "overhead_p50": median(overhead),
            "ratio_p50": median(ratios),
            "cold_service_p50": median(cold_ttft) * 1000.0,
        },
        "auth_to_upstream_ms": {
            "p50": median(upstream),
            "p90": percentile(upstream, 0.9),
            "target_p50": TARGET_MS,
            "met": median(upstream) <= TARGET_MS,
            "cold_p50": median([b.upstream_at_ms for b in cold]),
        },
        "segments_ms": {
            "warm": median_segments(warm),  # the prompt in vLLM's prefix cache
            "cold": median_segments(cold),  # the question's first ask
        },
        "stages_ms": median_stages(warm),
        "retrieval_ms": median_retrieval(warm),  # inside the retrieve stage: embed, bm25, ...
    }


def report(result: dict[str, Any]) -> None:
    ttft, up = result["ttft_ms"], result["auth_to_upstream_ms"]
    print(f"{result['questions']} SciFact test questions, {result['pairs']} pairs\n")
    print("| | service | vLLM direct | service - direct (median of pairs) | ratio |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| TTFT p50 ms (warm prompt) | {ttft['service_p50']:.1f} | {ttft['direct_p50']:.1f} "
        f"| **{ttft['overhead_p50']:.1f}** | {ttft['ratio_p50']:.2f} |"
    )
    print(
        f"\nauth -> upstream call p50 **{up['p50']:.1f} ms** (p90 {up['p90']:.1f}; "
        f"question's first ask {up['cold_p50']:.1f}); target <= {up['target_p50']:.0f} ms: "
        f"{'met' if up['met'] else 'not met'}\n"
    )
    print("| segment | warm miss ms (p50) | first ask ms (p50) |")
    print("| --- | --- | --- |")
    cold = result["segments_ms"]["cold"]
    for name, value in result["segments_ms"]["warm"].items():
        print(f"| {name} | {value:.2f} | {cold.get(name, float('nan')):.2f} |")
    print("\n| stage | p50 ms |")
    print("| --- | --- |")
    for name, value in result["stages_ms"].items():
        print(f"| {name} | {value:.2f} |")
    for name, value in result["retrieval_ms"].items():
        print(f"| retrieve: {name} | {value:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="pairs per question")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--extra-documents", type=int, default=None, help="default: all")
    parser.add_argument("--llm-url", default=None)
    parser.add_argument("--quick", action="store_true", help="4 questions, 300 other abstracts")
    args = parser.parse_args()
    if args.quick:
        args.questions, args.rounds = 4, 1
        args.extra_documents = 300 if args.extra_documents is None else args.extra_documents
    llm = vllm_url(args.llm_url)
    asked = questions(args.questions)
    index_dir, documents, chunks = scifact_tenant(asked, args.extra_documents, TENANT, "miss")
    redis = RedisServer()
    redis.start()
    exporter = InMemorySpanExporter()
    app = create_app(
        service_settings(redis.url, llm, index_dir), span_processors=[SimpleSpanProcessor(exporter)]
    )
    try:
        with LiveService(app) as live:
            services = app.state.services
            key = live.run(services.keys.create(TENANT, "bench", frozenset({"chat"})))
            result = asyncio.run(
                measure(live, exporter, key, llm, asked, args.rounds, args.max_tokens)
            )
    finally:
        redis.stop()
    result.update(documents=documents, chunks=chunks, llm_url=llm, quick=args.quick)
    path = write_result("miss", result)
    report(result)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
