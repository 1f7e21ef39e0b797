"""The model client's own CPU per streamed call, at 1 to 128 calls at once, with its calls in one
httpx connection pool or spread over several (``pipeline.model.client.POOLS``).

    .venv/bin/python -m bench.pool_bench [--streams 1 4 32 128] [--pools 1 8] [--rounds 5]
        [--calls 10] [--tokens 8] [--interval-ms 2]

httpcore's pool walks all of its connections on every request and at the end of every
response, and checks each idle one against all the others, so what one call costs grows with
the calls in flight. The stub model server (``bench.fake_upstream``, its own process: its CPU
is not counted) streams ``--tokens`` tokens ``--interval-ms`` apart; this process runs only
``LLMClient`` on uvloop and reads its own CPU time (user + system) per call. For each number of
streams, each pool count in turn (the order rotating by round): ``--streams`` tasks each make
``--calls`` calls one after another; the figure is the median over the rounds. Writes
bench/results/pool.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import uvloop

from bench.e2e import median, ratio, write_result
from bench.fake_upstream import running
from pipeline.model import client as client_module
from pipeline.model.client import LLMClient


async def cpu_per_call(url: str, pools: int, streams: int, calls: int, tokens: int) -> float:
    """µs of this process's CPU per call, ``streams`` at once, the client built with ``pools``
    pools (after one warm-up wave that opens the connections)."""
    client_module.POOLS = pools
    client = LLMClient(url)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2400}]}
    body["max_tokens"] = tokens

    async def caller(count: int) -> None:
        for _ in range(count):
            async for _chunk in client.stream_chat(body):
                pass

    try:
        await asyncio.gather(*(caller(2) for _ in range(streams)))
        started = time.process_time()
        await asyncio.gather(*(caller(calls) for _ in range(streams)))
        return (time.process_time() - started) / (streams * calls) * 1e6
    finally:
        await client.aclose()


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    levels: list[dict[str, Any]] = []
    for streams in args.streams:
        series: dict[int, list[float]] = {p: [] for p in args.pools}
        for number in range(args.rounds):
            turn = number % len(args.pools)
            for pools in args.pools[turn:] + args.pools[:turn]:
                cost = uvloop.run(cpu_per_call(url, pools, streams, args.calls, args.tokens))
                series[pools].append(cost)
        row: dict[str, Any] = {
            "streams": streams,
            "us_per_call": {str(p): median(v) for p, v in series.items()},
            "us_per_call_rounds": {str(p): v for p, v in series.items()},
        }
        first = args.pools[0]
        row["ratios"] = {
            str(p): ratio(row["us_per_call"][str(p)], row["us_per_call"][str(first)])
            for p in args.pools
        }
        cells = ", ".join(f"{p} pools {row['us_per_call'][str(p)]:.0f} µs" for p in args.pools)
        print(f"  {streams} streams: {cells}", flush=True)
        levels.append(row)
    return {"levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 32, 128])
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="per stream, one after another")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=2.0, help="between two tokens")
    args = parser.parse_args()
    if min(args.streams + args.pools) < 1 or args.rounds < 1 or args.calls < 1:
        parser.error("--streams, --pools, --rounds and --calls must be at least 1")
    with running(args.interval_ms) as (url, _):
        result = measure(url, args)
    result.update(vars(args))
    path = write_result("pool", result)
    heads = " | ".join(f"µs per call, {p} pools" for p in args.pools)
    print(f"\n| streams at once | {heads} | ratio to {args.pools[0]} pool(s) |")
    print("| --- | " + "--- | " * len(args.pools) + "--- |")
    for row in result["levels"]:
        cells = " | ".join(f"{row['us_per_call'][str(p)]:.0f}" for p in args.pools)
        ratios = ", ".join(f"{row['ratios'][str(p)]:.2f}x" for p in args.pools[1:])
        print(f"| {row['streams']} | {cells} | {ratios} |")
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
