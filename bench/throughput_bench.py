"""Streams under load: output tokens/s and time to first token at 1, 8, 32 and 128 concurrent
streaming clients, through the service and straight to vLLM, for the same final prompts, in
one run, alternating.

    .venv/bin/python -m bench.throughput_bench [--levels 1 8 32 128] [--rounds 2]
        [--requests 2] [--max-tokens 32] [--tenants 8] [--quick] [--llm-url URL]
        [--before DIR]

The prompts are built before the run, as the service would build them (``build_messages``: the
fixed instructions, two SciFact abstracts as sources, then a SciFact test question), and sent
as they are to both sides; the service runs with retrieval off (``rag serve`` as its own
process, otherwise its defaults: guards, routing, features, tools, rate limits, metrics) so it
passes them to vLLM unchanged and both sides do the same work. Every answer is
``--max-tokens`` long (a ``logit_bias`` keeps the model from ending early) and asks for its
usage, whose ``completion_tokens`` are counted.

With ``--before DIR`` (another checkout, a ``git worktree``), that code is served too, as a
third side of the same run, so a change's effect is read against bare vLLM in one run.

At each level, ``--rounds`` times, each side in turn (the order rotates by round): that many
clients, each on its own keep-alive connection, send ``--requests`` streamed requests one after
another; output tokens/s is all their completion tokens over the wave's wall time. The clients
are split over ``--tenants`` tenants (one key each), as a shared service's load would be: one
tenant alone is held to a quarter of the route's 64 upstream slots (RELIABILITY.md).

Writes bench/results/throughput.json (``bench.plots`` draws latency against concurrency).
Targets (issue 18), at 32 streams: tokens/s >= 0.95x bare vLLM's; TTFT p50 <= 1.1x. Beside
TTFT, two times read from bare vLLM's streams (p50): its second piece of answer text, and when
its text first gets through the service's output redaction (its default policy's
``StreamingRedactor`` fed vLLM's pieces as they came, after the wave). Exact redaction shows
the first word only once the text after it shows where it ends: the next token for most
answers, several for a first word of several tokens ("Rip" "amy" "cin"). The service's TTFT
over the second is what it adds beyond one engine step; over the released text, what it adds
beyond the wait exact redaction needs whatever serves it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from bench.e2e import (
    NO_CACHE,
    StreamConnection,
    Streamed,
    chat_request,
    first_released,
    median,
    percentile,
    ratio,
    serve_sides,
    vllm_url,
    write_result,
)
from bench.retrieval_data import load_corpus
from bench.ttft_bench import questions
from pipeline.context import Passage
from pipeline.guards.arguments import redactor_factory
from pipeline.guards.policy import GuardPolicy
from pipeline.model.prompt import build_messages
from tests.support.servers import UNENDING, RedisServer


def prompts(count: int, sources: int = 2) -> list[list[dict[str, Any]]]:
    """``count`` final prompts: a SciFact test question after ``sources`` abstracts (its
    relevant ones first), laid out as the service lays out a retrieved prompt."""
    corpus = {d.id: d for d in load_corpus()}
    spare = sorted(corpus)
    random.Random(18).shuffle(spare)
    built = []
    for number, (question, relevant) in enumerate(questions(count)):
        ids = (relevant + spare[number * sources :])[:sources]
        passages = [
            Passage(i, f"{i}#0", corpus[i].title, corpus[i].text, 1.0 - n / 10)
            for n, i in enumerate(ids)
        ]
        built.append(build_messages([{"role": "user", "content": question}], passages))
    return built


async def wave(
    base_url: str,
    keys: list[str],
    bodies: list[dict[str, Any]],
    clients: int,
    requests: int,
    offset: int,
) -> tuple[list[Streamed], float]:
    """``clients`` connections, each sending ``requests`` of ``bodies`` in turn; the answers
    and the wave's wall time. A body is always sent with the same key (its index's): the
    service keeps vLLM's prefix cache per tenant (``pipeline.model.salt``), so a prompt the
    warm-up sent as one tenant is cached for that tenant only."""
    answers: list[Streamed] = []

    async def client(number: int) -> None:
        connection = StreamConnection(base_url, NO_CACHE, timed=True)
        try:
            for sent in range(requests):
                index = (offset + number * requests + sent) % len(bodies)
                key = {"Authorization": f"Bearer {keys[index % len(keys)]}"} if keys else {}
                answers.append(await connection.send(bodies[index], key))
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    return answers, time.perf_counter() - started


def tally(answers: list[Streamed], wall: float) -> dict[str, Any]:
    good = [a for a in answers if a.ok]
    ttfts = [a.ttft_s for a in good if a.ttft_s is not None]
    seconds = [a.second_s for a in good if a.second_s is not None]
    redactor = redactor_factory(GuardPolicy())  # the service's default output policy
    released = [t for a in good if (t := first_released(a.pieces, redactor(""))) is not None]
    tokens = sum(a.completion_tokens for a in good)
    return {
        "answers": len(answers),
        "failed": len(answers) - len(good),
        "failures": sorted({f"{a.status} {a.body[:120]!r}" for a in answers if not a.ok})[:3],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttfts": ttfts,
        "seconds": seconds,
        "released": released,
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side at one level, over its rounds: tokens/s over all waves, TTFT percentiles."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    seconds = [t for r in runs for t in r["seconds"]]
    released = [t for r in runs for t in r["released"]]
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    cpu = [r["cpu_s"] for r in runs if "cpu_s" in r]
    return {
        "cpu_us_per_token": sum(cpu) / tokens * 1e6 if cpu and tokens else None,
        "answers": sum(r["answers"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "failures": [f for r in runs for f in r["failures"]][:3],
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs],
        "ttft_p50_ms": median(ttfts) * 1000.0,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000.0,
        # The second piece of text: the earliest a filter that needs the next token to decide
        # the first (the service's exact output redaction) can show the first word.
        "second_p50_ms": median(seconds) * 1000.0,
        # The first text the service's default output redaction lets through: the earliest any
        # server that redacts exactly can show it.
        "released_p50_ms": median(released) * 1000.0,
    }


async def measure(
    urls: dict[str, str],
    keys: dict[str, list[str]],
    args: argparse.Namespace,
    service_cpu: dict[str, Callable[[], float]] | None = None,
) -> dict[str, Any]:
    """Each level's rounds, every side (``urls``: "service", "vllm", and "before" with
    ``--before``), the order rotating by round; with ``service_cpu`` (a service process's CPU
    seconds so far, by side), also what each service spent per output token it relayed: on
    cores it shares with vLLM, that is time the engine does not get."""
    sides = list(urls)
    cpu_of = service_cpu or {}
    bodies = [chat_request(p, args.max_tokens, logit_bias=UNENDING) for p in prompts(args.prompts)]
    # Warm-up: every prompt once through each side (vLLM's prefix cache then holds them all,
    # for every side alike).
    for side in sides:
        each = -(-len(bodies) // 4)
        answers, _ = await wave(urls[side], keys.get(side, []), bodies, 4, each, 0)
        if not all(a.ok for a in answers):
            bad = next(a for a in answers if not a.ok)
            raise RuntimeError(f"{side} warm-up: {bad.status} {bad.body[:300]!r}")
    levels: list[dict[str, Any]] = []
    for level in args.levels:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for number in range(args.rounds):
            turn = number % len(sides)
            for side in sides[turn:] + sides[:turn]:
                cpu = cpu_of[side]() if side in cpu_of else 0.0
                answers, wall = await wave(
                    urls[side], keys.get(side, []), bodies, level, args.requests, number * 7
                )
                runs[side].append(tally(answers, wall))
                if side in cpu_of:
                    runs[side][-1]["cpu_s"] = cpu_of[side]() - cpu
        row: dict[str, Any] = {"concurrency": level, **{s: combine(runs[s]) for s in sides}}
        for side in (s for s in sides if s != "vllm"):
            prefix = "" if side == "service" else f"{side}_"
            row[f"{prefix}tokens_ratio"] = ratio(
                row[side]["tokens_per_s"], row["vllm"]["tokens_per_s"]
            )
            row[f"{prefix}ttft_p50_ratio"] = ratio(
                row[side]["ttft_p50_ms"], row["vllm"]["ttft_p50_ms"]
            )
            # Against vLLM's second piece of text: what the side adds beyond the one engine
            # step that exact output redaction waits for.
            row[f"{prefix}ttft_over_second_ratio"] = ratio(
                row[side]["ttft_p50_ms"], row["vllm"]["second_p50_ms"]
            )
            # ... and beyond the whole wait of exact redaction (the first word's end).
            row[f"{prefix}ttft_over_released_ratio"] = ratio(
                row[side]["ttft_p50_ms"], row["vllm"]["released_p50_ms"]
            )
            print(
                f"  {level:>4} streams, {side}: tokens/s {row[side]['tokens_per_s']:.1f} vs "
                f"{row['vllm']['tokens_per_s']:.1f} ({row[f'{prefix}tokens_ratio']:.2f}x), TTFT "
                f"p50 {row[side]['ttft_p50_ms']:.0f} vs {row['vllm']['ttft_p50_ms']:.0f} ms "
                f"({row[f'{prefix}ttft_p50_ratio']:.2f}x; vLLM's second piece of text "
                f"{row['vllm']['second_p50_ms']:.0f} ms, "
                f"{row[f'{prefix}ttft_over_second_ratio']:.2f}x; its text through the "
                f"service's redaction {row['vllm']['released_p50_ms']:.0f} ms, "
                f"{row[f'{prefix}ttft_over_released_ratio']:.2f}x), service CPU "
                f"{row[side]['cpu_us_per_token'] or 0:.0f} µs per token",
                flush=True,
            )
        levels.append(row)
    at_32 = next((row for row in levels if row["concurrency"] == 32), None)
    return {
        "levels": levels,
        "at_32": None
        if at_32 is None
        else {
            "tokens_ratio": at_32["tokens_ratio"],
            "ttft_p50_ratio": at_32["ttft_p50_ratio"],
            "ttft_over_second_ratio": at_32["ttft_over_second_ratio"],
            "ttft_over_released_ratio": at_32["ttft_over_released_ratio"],
            "tokens_target": 0.95,
            "ttft_target": 1.1,
        },
    }


def report(result: dict[str, Any]) -> None:
    print(
        "\n| streams | side | tokens/s | tokens/s vLLM | ratio | TTFT p50 ms side / vLLM "
        "| ratio | vLLM's second text p50 ms | side's TTFT / it | vLLM's text through the "
        "redaction p50 ms | side's TTFT / it | TTFT p99 ms side / vLLM | failed "
        "| service CPU µs / token |"
    )
    print("| --- " * 14 + "|")
    for row in result["levels"]:
        v = row["vllm"]
        for side in (k for k in ("service", "before") if k in row):
            s, prefix = row[side], "" if side == "service" else f"{side}_"
            print(
                f"| {row['concurrency']} | {side} | {s['tokens_per_s']:.1f} "
                f"| {v['tokens_per_s']:.1f} | **{row[f'{prefix}tokens_ratio']:.2f}** "
                f"| {s['ttft_p50_ms']:.0f} / {v['ttft_p50_ms']:.0f} "
                f"| **{row[f'{prefix}ttft_p50_ratio']:.2f}** "
                f"| {v['second_p50_ms']:.0f} | {row[f'{prefix}ttft_over_second_ratio']:.2f} "
                f"| {v['released_p50_ms']:.0f} | {row[f'{prefix}ttft_over_released_ratio']:.2f} "
                f"| {s['ttft_p99_ms']:.0f} / {v['ttft_p99_ms']:.0f} "
                f"| {s['failed']} / {v['failed']} | {s['cpu_us_per_token'] or 0:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=2, help="per client per wave")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--llm-url", default=None)
    parser.add_argument("--quick", action="store_true", help="1, 8 and 32 streams, one round")
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="another checkout (a git worktree) served beside this one, as a third side in the "
        "same run: its ratios to bare vLLM next to this checkout's",
    )
    parser.add_argument(
        "--guards-off",
        action="store_true",
        help="the service without guards (RAG_GUARD__ENABLED=false): what the output guard's "
        "streaming redaction, which holds each word back until the next shows it complete, costs",
    )
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the service's process (repeatable), e.g. RAG_GUARD__SIMILARITY=false",
    )
    args = parser.parse_args()
    if args.quick:
        args.levels, args.rounds, args.requests, args.max_tokens = [1, 8, 32], 1, 1, 16
    llm = vllm_url(args.llm_url)
    redis = RedisServer()
    redis.start()
    try:
        # Retrieval off: the prompts arrive built, and the process starts in seconds.
        env = {"RAG_RETRIEVAL__ENABLED": "false"}
        if args.guards_off:
            env["RAG_GUARD__ENABLED"] = "false"
        env.update(item.split("=", 1) for item in args.service_env)
        with ExitStack() as stack:
            services, keys = serve_sides(
                stack, args.before, redis.url, llm, args.tenants, "load", **env
            )
            urls = {"service": services["service"].url, "vllm": llm}
            urls.update({side: s.url for side, s in services.items() if side != "service"})
            cpu = {side: service.cpu_seconds for side, service in services.items()}
            result = asyncio.run(measure(urls, keys, args, cpu))
    finally:
        redis.stop()
    result.update(
        llm_url=llm,
        guards=not args.guards_off,
        service_env=args.service_env,
        max_tokens=args.max_tokens,
        requests_per_client=args.requests,
        rounds=args.rounds,
        tenants=args.tenants,
        quick=args.quick,
        before=args.before,
    )
    path = write_result("throughput", result)
    report(result)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
