"""Request coalescing (issue 18): bursts of identical concurrent misses, with coalescing on and
off, side by side in one run.

    python -m bench.coalesce_bench [--requests 256] [--prompts 16] [--rounds 3]
                                   [--max-tokens 16] [--llm-url http://127.0.0.1:8001]
                                   [--default-stages] [--arms on off "on x2"]
                                   [--spread-s 0] [--before DIR]
                                   [--out bench/results/coalesce.json] [--cluster]

Three service processes (`rag serve`, default settings but retrieval's documents: the tenant
has none) share one private redis-server and the real vLLM: ``on`` (coalescing on), ``off``
(``RAG_CACHE__COALESCE=false``) and ``on x2``, two coalescing replicas with one Redis key prefix,
the burst split between them. Each round sends, to each arm in turn (the order rotates per
round), ``--requests`` plain chat requests at once over ``--prompts`` prompts new to the cache
(greedy, ``--max-tokens``), one keep-alive raw socket each (``bench.rawclient``: the request's
bytes built once, the answer read by its Content-Length). Per arm: generations (the services'
``rag_llm_calls_total`` before and after; vLLM's own ``vllm:request_success_total`` is printed
too, but the server is shared and counts other clients' requests), p50 and p99 latency of the
requests, the burst's wall time, and how many stages degraded (past their time budgets: the
services' ``rag_stage_duration_seconds_count{status="degraded"}``); medians over the rounds, and
the ratios off / on.

The arm ``on x2, one degraded`` is two replicas with routing on, the second's budget so short
(0.1 ms: the router embeds the question) that its route stage degrades on every request it
runs: what a replica whose router is slow shares. ``--spread-s`` sends the burst's requests
evenly over that many seconds rather than at once (traffic that keeps coming while a flight
is under way). ``--before DIR`` (another
checkout, a ``git worktree``) serves each arm with that code too, as ``{arm} (before)``, in the
same rounds.

Routing and the feature lookup are off unless ``--default-stages`` (on at their production
budgets). A stage that degrades makes its request share only with requests degraded alike
(``pipeline.stages.cache.unshareable``), so generations go above one per prompt by how the
degradations fall; since the budgets count only time in which the event loop ran on time
(``pipeline.looptime``), a burst on two cores no longer makes them degrade.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.rawclient import encode_request, read_response
from tests.support.process import ServiceProcess
from tests.support.servers import RedisClusterServers, RedisServer

WORDS = [
    "apple", "river", "candle", "tiger", "violin", "copper", "garden", "rocket",
    "pepper", "island", "marble", "falcon", "lemon", "harbor", "silver", "meadow",
]  # fmt: skip
CALLS = re.compile(r"^rag_llm_calls_total\{[^}]*\} ([0-9.e+]+)$", re.M)
VLLM_DONE = re.compile(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", re.M)
DEGRADED = re.compile(  # by stage
    r'^rag_stage_duration_seconds_count\{(?=[^}]*status="degraded")[^}]*\bstage="([^"]+)"[^}]*\}'
    r" ([0-9.e+]+)$",
    re.M,
)
REDIS_ERRORS = re.compile(r"^rag_redis_errors_total\{[^}]*\} ([0-9.e+]+)$", re.M)
ALONE = re.compile(r'^rag_coalesced_total\{role="off"\} ([0-9.e+]+)$', re.M)
# Each arm's replicas, by the environment each adds (two or more share one key prefix).
ARMS: dict[str, tuple[dict[str, str], ...]] = {
    "on": ({},),
    "off": ({"RAG_CACHE__COALESCE": "false"},),
    "on x2": ({}, {}),
    "on x2, one degraded": (
        {"RAG_ROUTING__ENABLED": "true"},
        {"RAG_ROUTING__ENABLED": "true", "RAG_ROUTING__TIMEOUT_SECONDS": "0.0001"},
    ),
}
DEFAULT_ARMS = ("on", "off", "on x2")


def degraded_by_stage(urls: list[str]) -> Counter[str]:
    """How many times each stage degraded, over the services."""
    counts: Counter[str] = Counter()
    for url in urls:
        for stage, value in DEGRADED.findall(httpx.get(f"{url}/metrics", timeout=10).text):
            counts[stage] += int(float(value))
    return counts


def counter(url: str, pattern: re.Pattern[str]) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(value) for value in pattern.findall(text))


async def burst(
    urls: list[str],
    key: str,
    prompts: list[str],
    requests: int,
    max_tokens: int,
    spread_s: float = 0.0,
) -> dict[str, Any]:
    """``requests`` plain requests, request i asking prompt i % len(prompts) of
    ``urls[(i // len(prompts)) % len(urls)]``, at once or (``spread_s``) request i sent
    ``i * spread_s / requests`` seconds after the first; every connection is open before the
    first request goes. Each latency is from its request's own sending."""
    messages = []
    for i in range(requests):
        body = orjson.dumps(
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "rag": {"enabled": False},
            }
        )
        url = f"{urls[(i // len(prompts)) % len(urls)]}/v1/chat/completions"
        messages.append(encode_request(url, body, {"Authorization": f"Bearer {key}"}))
    connections = [await asyncio.open_connection(host, port) for host, port, _ in messages]
    latencies: list[float] = []
    answers: dict[str, set[str]] = {}
    errors: dict[str, int] = {}  # by status

    async def one(index: int) -> None:
        reader, writer = connections[index]
        if spread_s > 0:
            await asyncio.sleep(index * spread_s / requests)
        started = time.perf_counter()
        writer.write(messages[index][2])
        status, content = await read_response(reader)
        latencies.append(time.perf_counter() - started)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
            return
        text = orjson.loads(content)["choices"][0]["message"]["content"]
        answers.setdefault(prompts[index % len(prompts)], set()).add(text)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        for _, writer in connections:
            writer.close()
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000,
        "wall_s": wall,
        "answers_per_prompt": max((len(texts) for texts in answers.values()), default=0),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    default_llm = os.environ.get("RAG_TEST_VLLM_URL", "http://127.0.0.1:8001")
    parser.add_argument("--llm-url", default=default_llm)
    parser.add_argument(
        "--default-stages",
        action="store_true",
        help="routing and the feature lookup on, at their default budgets",
    )
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(DEFAULT_ARMS))
    parser.add_argument("--spread-s", type=float, default=0.0)
    parser.add_argument("--before", help="another checkout, served as each arm's (before)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/coalesce.json"))
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="a Redis Cluster of three primaries instead of one Redis (RAG_REDIS__CLUSTER)",
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="rag-coalesce-bench-"))
    redis: RedisServer | RedisClusterServers = (
        RedisClusterServers() if args.cluster else RedisServer()
    )
    redis.start()
    # A burst of 256 is the point, not a rate limit; the same long deadline in every arm (the
    # arm without coalescing queues 256 generations for the route's slots). Routing and the
    # feature lookup off unless asked for (see the module's docstring).
    common = {
        "RAG_LIMITS__ENABLED": "false",
        "RAG_SERVER__REQUEST_TIMEOUT_SECONDS": "300",
        "RAG_REDIS__CLUSTER": str(args.cluster).lower(),
    }
    if not args.default_stages:
        common |= {"RAG_ROUTING__ENABLED": "false", "RAG_FEATURES__ENABLED": "false"}
    try:
        with ExitStack() as stack:
            arms: dict[str, list[ServiceProcess]] = {}
            checkouts: dict[str, dict[str, str]] = {"": {}}
            if args.before:
                checkouts[" (before)"] = {"PYTHONPATH": str(Path(args.before).resolve())}
            for (side, code), name in itertools.product(checkouts.items(), args.arms):
                replicas = ARMS[name]
                services = []
                shared = {"RAG_REDIS__KEY_PREFIX": f"b{uuid.uuid4().hex[:8]}:"}  # the arm's
                for number, env in enumerate(replicas):
                    folder = Path(tempfile.mkdtemp(prefix=f"{number}-", dir=workdir))
                    process = ServiceProcess(
                        redis.url, args.llm_url, folder, **(common | shared | env | code)
                    )
                    services.append(stack.enter_context(process))
                arms[name + side] = services
            keys = {name: services[0].key("bench") for name, services in arms.items()}
            results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
            order = list(arms)
            for round_ in range(args.rounds):
                for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                    services = arms[name]
                    tag = uuid.uuid4().hex[:6]
                    prompts = [
                        f"Say the word {WORDS[i % len(WORDS)]} ({i}, {tag})."
                        for i in range(args.prompts)
                    ]
                    before = sum(counter(s.url, CALLS) for s in services)
                    vllm_before = counter(args.llm_url, VLLM_DONE)
                    degraded_before = degraded_by_stage([s.url for s in services])
                    redis_before = sum(counter(s.url, REDIS_ERRORS) for s in services)
                    alone_before = sum(counter(s.url, ALONE) for s in services)
                    figures = asyncio.run(
                        burst(
                            [s.url for s in services],
                            keys[name],
                            prompts,
                            args.requests,
                            args.max_tokens,
                            args.spread_s,
                        )
                    )
                    figures["generations"] = sum(counter(s.url, CALLS) for s in services) - before
                    figures["vllm_requests"] = counter(args.llm_url, VLLM_DONE) - vllm_before
                    by_stage = degraded_by_stage([s.url for s in services]) - degraded_before
                    figures["degraded_stages"] = sum(by_stage.values())
                    figures["degraded_by_stage"] = dict(by_stage)
                    figures["redis_errors"] = (
                        sum(counter(s.url, REDIS_ERRORS) for s in services) - redis_before
                    )
                    figures["alone"] = sum(counter(s.url, ALONE) for s in services) - alone_before
                    results[name].append(figures)
                    print(
                        f"round {round_ + 1} {name:6}: {figures['generations']:.0f} generations "
                        f"(vLLM saw {figures['vllm_requests']:.0f}), "
                        f"{figures['degraded_stages']:.0f} stages degraded "
                        f"{figures['degraded_by_stage'] or ''}, "
                        f"{figures['alone']:.0f} generated alone, "
                        f"{figures['redis_errors']:.0f} Redis errors, p50 "
                        f"{figures['p50_ms']:.0f} ms, p99 {figures['p99_ms']:.0f} ms, wall "
                        f"{figures['wall_s']:.2f} s, answers per prompt "
                        f"{figures['answers_per_prompt']}, errors {figures['errors']}",
                        flush=True,
                    )
    finally:
        redis.stop()

    summary = {
        name: {
            field: statistics.median(r[field] for r in rounds)
            for field in (
                "generations",
                "vllm_requests",
                "degraded_stages",
                "p50_ms",
                "p99_ms",
                "wall_s",
            )
        }
        for name, rounds in results.items()
    }
    print(
        f"\nmedians of {args.rounds} rounds, {args.requests} requests over {args.prompts} prompts"
    )
    for name, figures in summary.items():
        print(
            f"{name:6}: generations {figures['generations']:.0f}, degraded stages "
            f"{figures['degraded_stages']:.0f}, p50 {figures['p50_ms']:.0f} ms,"
            f" p99 {figures['p99_ms']:.0f} ms, wall {figures['wall_s']:.2f} s"
        )
    if "on" in summary and "off" in summary:
        on, off = summary["on"], summary["off"]
        print(
            f"off / on: p50 {off['p50_ms'] / on['p50_ms']:.2f}x,"
            f" p99 {off['p99_ms'] / on['p99_ms']:.2f}x, wall {off['wall_s'] / on['wall_s']:.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(
        orjson.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": results,
                      "medians": summary}, option=orjson.OPT_INDENT_2)
    )  # fmt: skip


if __name__ == "__main__":
    main()
