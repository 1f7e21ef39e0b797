"""What the service spends of the CPU per streamed request and per token it relays, measured
against a model server that costs almost nothing (``bench.fake_upstream``), so the figure is the
service's own and not the engine's noise.

    .venv/bin/python -m bench.stream_cost [--before DIR] [--clients 16] [--requests 8]
        [--rounds 5] [--lengths 1 65] [--interval-ms 10] [--service-env KEY=VALUE] [--quick]

On these 2-core machines the service shares the cores with vLLM: every millisecond it spends
is one the engine does not get, so its cost per token bounds its tokens/s against bare vLLM
(issue 18: >= 0.95x at 32 streams). The service runs as ``rag serve`` with its defaults
(guards, routing, features, tools, rate limits, metrics, telemetry) and retrieval off, on the
same final prompts as ``bench.throughput_bench``, uncached. Each round, each side in turn (the
order rotates), for each answer length: ``--clients`` keep-alive connections send
``--requests`` streamed requests each, and the service process's CPU time (user + system, from
``/proc``) over the wave is divided by the answers. The cost of a token is the difference
between the two lengths' per-request costs over the difference in tokens; what is left at
length 0 is the fixed cost of a request. Medians over the rounds. The stub's own CPU over the
same waves is reported beside them: what reading a request and writing a token costs a process
that does nothing else, a floor for the service's figures.

With ``--before DIR`` (another checkout, a ``git worktree``) that code is served too, side by
side, and the ratios are this checkout's over it. Writes bench/results/stream_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from bench.e2e import chat_request, median, ratio, serve_sides, write_result
from bench.fake_upstream import running
from bench.throughput_bench import prompts, wave
from tests.support.process import process_cpu_seconds
from tests.support.servers import RedisServer

STUB = "stub model server"


def fixed_and_per_token(costs: dict[int, float]) -> tuple[float, float]:
    """A request's fixed CPU (ms) and its CPU per token (µs), from the per-request CPU (ms) at
    two or more answer lengths (a least-squares line)."""
    lengths = sorted(costs)
    mean_x = sum(lengths) / len(lengths)
    mean_y = sum(costs[n] for n in lengths) / len(lengths)
    spread = sum((n - mean_x) ** 2 for n in lengths)
    slope = sum((n - mean_x) * (costs[n] - mean_y) for n in lengths) / spread
    return mean_y - slope * mean_x, slope * 1000.0


async def measure(
    urls: dict[str, str],
    keys: dict[str, list[str]],
    cpu_of: dict[str, Callable[[], float]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    sides = list(urls)  # the services
    messages = prompts(args.prompts)
    bodies = {n: [chat_request(m, n) for m in messages] for n in args.lengths}
    for side in sides:  # warm-up: every prompt and length once
        for length in args.lengths:
            answers, _ = await wave(urls[side], keys[side], bodies[length], 4, 4, 0)
            if not all(a.ok for a in answers):
                bad = next(a for a in answers if not a.ok)
                raise RuntimeError(f"{side} warm-up: {bad.status} {bad.body[:300]!r}")
    rounds: dict[str, dict[int, list[float]]] = {s: {n: [] for n in args.lengths} for s in sides}
    # The stub's own cost on the same waves: one read of the request, one write per token.
    stub: dict[int, list[float]] = {n: [] for n in args.lengths}
    for number in range(args.rounds):
        turn = number % len(sides)
        for side in sides[turn:] + sides[:turn]:
            for length in args.lengths:
                before, stub_before = cpu_of[side](), cpu_of[STUB]()
                answers, _ = await wave(
                    urls[side], keys[side], bodies[length], args.clients, args.requests, number
                )
                spent = cpu_of[side]() - before
                stub[length].append((cpu_of[STUB]() - stub_before) / len(answers) * 1000.0)
                failed = [a for a in answers if not a.ok]
                if failed:
                    raise RuntimeError(f"{side}: {failed[0].status} {failed[0].body[:300]!r}")
                rounds[side][length].append(spent / len(answers) * 1000.0)
        print(f"  round {number + 1}/{args.rounds} done", flush=True)
    result: dict[str, Any] = {"sides": {}}
    for side in [*sides, STUB]:
        series = stub if side == STUB else rounds[side]
        per_request = {n: median(series[n]) for n in args.lengths}
        fixed_ms, token_us = fixed_and_per_token(per_request)
        result["sides"][side] = {
            "cpu_ms_per_request": {str(n): v for n, v in per_request.items()},
            "cpu_ms_per_request_rounds": {str(n): v for n, v in series.items()},
            "fixed_ms": fixed_ms,
            "per_token_us": token_us,
        }
    if "before" in result["sides"]:
        now, then = result["sides"]["service"], result["sides"]["before"]
        result["ratios"] = {
            "fixed": ratio(now["fixed_ms"], then["fixed_ms"]),
            "per_token": ratio(now["per_token_us"], then["per_token_us"]),
            **{
                f"request_{n}": ratio(
                    now["cpu_ms_per_request"][str(n)], then["cpu_ms_per_request"][str(n)]
                )
                for n in args.lengths
            },
        }
    return result


def report(result: dict[str, Any], lengths: list[int]) -> None:
    heads = " | ".join(f"CPU ms / request, {n} tokens" for n in lengths)
    print(f"\n| side | {heads} | fixed ms / request | µs / token |")
    print("| --- | " + "--- | " * len(lengths) + "--- | --- |")
    for side, row in result["sides"].items():
        cells = " | ".join(f"{row['cpu_ms_per_request'][str(n)]:.2f}" for n in lengths)
        print(f"| {side} | {cells} | {row['fixed_ms']:.2f} | {row['per_token_us']:.0f} |")
    if "ratios" in result:
        print("ratios, this checkout over --before:", result["ratios"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", metavar="DIR", help="another checkout served beside this one")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="per client per wave")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 65])
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between two tokens")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 clients x 4 requests")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.clients, args.requests = 2, 8, 4
    if len(set(args.lengths)) < 2:
        parser.error("--lengths needs two different answer lengths")
    redis = RedisServer()
    redis.start()
    try:
        env = {"RAG_RETRIEVAL__ENABLED": "false"}
        env.update(item.split("=", 1) for item in args.service_env)
        with ExitStack() as stack:
            llm, stub_pid = stack.enter_context(running(args.interval_ms))
            services, keys = serve_sides(
                stack, args.before, redis.url, llm, args.tenants, "cost", **env
            )
            urls = {side: s.url for side, s in services.items()}
            cpu = {side: s.cpu_seconds for side, s in services.items()}
            cpu[STUB] = lambda: process_cpu_seconds(stub_pid)
            result = asyncio.run(measure(urls, keys, cpu, args))
    finally:
        redis.stop()
    result.update(
        clients=args.clients,
        requests_per_client=args.requests,
        rounds=args.rounds,
        lengths=args.lengths,
        interval_ms=args.interval_ms,
        service_env=args.service_env,
        before=args.before,
    )
    path = write_result("stream_cost", result)
    report(result, args.lengths)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
