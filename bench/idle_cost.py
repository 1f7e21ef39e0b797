"""What a replica spends of the CPU at rest: no request, only its own timers and listeners (the
loop's clock, the key listener's and the job workers' long polls, the metrics).

    .venv/bin/python -m bench.idle_cost [--before DIR] [--windows 6] [--window-s 10]
        [--service-env KEY=VALUE]

On these 2-core machines a replica shares the cores with vLLM, and a platform runs many
replicas that are mostly waiting: what one spends doing nothing is spent all day. The service
runs as ``rag serve`` with its defaults (retrieval off, a stub model server that is never
called); with ``--before DIR`` (another checkout, a ``git worktree``) that code is served
beside it, both resting at once, so both are measured over the same windows. Each window, each
process's CPU time (user + system, from ``/proc``) over ``--window-s`` is divided by it: ms of
CPU per second at rest. Medians over the windows; the ratio is this checkout's over the other's.
Writes bench/results/idle_cost.json.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from typing import Any

from bench.e2e import median, ratio, serve_sides, write_result
from bench.fake_upstream import running
from tests.support.servers import RedisServer

SETTLE_S = 5.0  # after start-up: imports done, listeners connected, the first polls answered


def measure(
    services: dict[str, Any], windows: int, window_s: float, settle_s: float = SETTLE_S
) -> dict[str, Any]:
    """Each side's ms of CPU per second at rest, per window (all sides over the same windows):
    ``services`` by side, each with ``cpu_seconds()``."""
    time.sleep(settle_s)
    series: dict[str, list[float]] = {side: [] for side in services}
    for number in range(windows):
        before = {side: s.cpu_seconds() for side, s in services.items()}
        started = time.monotonic()
        time.sleep(window_s)
        elapsed = time.monotonic() - started
        for side, service in services.items():
            series[side].append((service.cpu_seconds() - before[side]) / elapsed * 1000.0)
        cells = ", ".join(f"{side} {values[-1]:.1f}" for side, values in series.items())
        print(f"  window {number + 1}/{windows}: {cells} ms CPU per s", flush=True)
    result: dict[str, Any] = {
        "sides": {
            side: {"ms_per_s": median(values), "ms_per_s_windows": values}
            for side, values in series.items()
        }
    }
    if "before" in series:
        result["ratio"] = ratio(
            result["sides"]["service"]["ms_per_s"], result["sides"]["before"]["ms_per_s"]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", metavar="DIR", help="another checkout served beside this one")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.windows < 1 or args.window_s <= 0:
        parser.error("--windows must be at least 1 and --window-s above 0")
    redis = RedisServer()
    redis.start()
    try:
        env = {"RAG_RETRIEVAL__ENABLED": "false"}
        env.update(item.split("=", 1) for item in args.service_env)
        with ExitStack() as stack:
            llm, _ = stack.enter_context(running())
            services, _ = serve_sides(stack, args.before, redis.url, llm, 1, "idle", **env)
            result = measure(services, args.windows, args.window_s)
    finally:
        redis.stop()
    result.update(
        windows=args.windows,
        window_s=args.window_s,
        service_env=args.service_env,
        before=args.before,
    )
    path = write_result("idle_cost", result)
    print("\n| side | ms of CPU per s at rest (median) | windows |")
    print("| --- | --- | --- |")
    for side, row in result["sides"].items():
        windows = ", ".join(f"{v:.1f}" for v in row["ms_per_s_windows"])
        print(f"| {side} | {row['ms_per_s']:.1f} | {windows} |")
    if "ratio" in result:
        print(f"ratio, this checkout over --before: {result['ratio']:.2f}")
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
