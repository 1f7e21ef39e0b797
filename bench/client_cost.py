"""The model client's own CPU per streamed call and per token it reads, this checkout against
another (``--before``, a ``git worktree``), side by side, against the stub model server.

    .venv/bin/python -m bench.client_cost --before DIR [--streams 32] [--rounds 5]
        [--calls 10] [--lengths 1 65] [--interval-ms 2]

Each measure is ``bench.pool_bench.cpu_per_call`` (the client alone on uvloop, its own CPU time
per call, ``--streams`` calls at once) in a fresh process started in the checkout measured, so
each side runs its own ``pipeline.model``; the sides alternate, the order rotating by round.
As in ``bench.stream_cost``, the cost of a token is the slope over the answer lengths and what
is left at length 0 a call's fixed cost; medians over the rounds. Writes
bench/results/client_cost.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.e2e import median, ratio, write_result
from bench.fake_upstream import running
from bench.stream_cost import fixed_and_per_token

HERE = str(Path(__file__).resolve().parents[1])
CHILD = (
    "import sys, uvloop\n"
    "from bench.pool_bench import cpu_per_call\n"
    "url, pools, streams, calls, tokens = sys.argv[1], *map(int, sys.argv[2:])\n"
    "print(uvloop.run(cpu_per_call(url, pools, streams, calls, tokens)))\n"
)


def cpu_per_call(root: str, url: str, args: argparse.Namespace, tokens: int) -> float:
    """µs of the client's CPU per call, measured in a process running ``root``'s code."""
    command = [sys.executable, "-c", CHILD, url, "8", str(args.streams), str(args.calls)]
    # Its own checkout's code: the working directory, not a PYTHONPATH inherited from here.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [*command, str(tokens)], cwd=root, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measure in {root} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measure(url: str, roots: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    sides = list(roots)
    series: dict[str, dict[int, list[float]]] = {s: {n: [] for n in args.lengths} for s in sides}
    for number in range(args.rounds):
        turn = number % len(sides)
        for tokens in args.lengths:
            for side in sides[turn:] + sides[:turn]:
                series[side][tokens].append(cpu_per_call(roots[side], url, args, tokens))
        print(f"  round {number + 1}/{args.rounds} done", flush=True)
    result: dict[str, Any] = {"sides": {}}
    for side in sides:
        per_call = {n: median(v) for n, v in series[side].items()}
        fixed, per_token = fixed_and_per_token({n: c / 1000.0 for n, c in per_call.items()})
        result["sides"][side] = {
            "us_per_call": {str(n): c for n, c in per_call.items()},
            "us_per_call_rounds": {str(n): v for n, v in series[side].items()},
            "fixed_us": fixed * 1000.0,
            "us_per_token": per_token,
        }
    after, before = (result["sides"][s] for s in sides)
    result["ratios"] = {
        "fixed": ratio(after["fixed_us"], before["fixed_us"]),
        "per_token": ratio(after["us_per_token"], before["us_per_token"]),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="per stream, one after another")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 65])
    parser.add_argument("--interval-ms", type=float, default=2.0, help="between two tokens")
    args = parser.parse_args()
    if len(set(args.lengths)) < 2 or min(args.streams, args.rounds, args.calls) < 1:
        parser.error("two answer lengths or more; --streams, --rounds, --calls at least 1")
    roots = {"this checkout": HERE, "before": str(Path(args.before).resolve())}
    with running(args.interval_ms) as (url, _):
        result = measure(url, roots, args)
    result.update(vars(args))
    path = write_result("client_cost", result)
    print("\n| side | fixed µs / call | µs / token |\n| --- | --- | --- |")
    for side, row in result["sides"].items():
        print(f"| {side} | {row['fixed_us']:.0f} | {row['us_per_token']:.1f} |")
    ratios = result["ratios"]
    print(f"\nratios: fixed {ratios['fixed']:.2f}x, per token {ratios['per_token']:.2f}x")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
