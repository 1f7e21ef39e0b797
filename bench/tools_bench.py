"""Tools: what the calculator costs, what the invoker adds per call, and whether nearest-centroid
over the query embedding would help the planner's rules.

    python -m bench.tools_bench [--calls 3000] [--rounds 5] [--skip-centroid]

1. Calculator: p50/p99 of ``calculate()`` per expression, accepted and refused ones (the
   refusals of huge powers and attribute access must cost about what arithmetic costs).
2. Invoker overhead per call, side by side in one run: a tool that returns at once, awaited
   bare, and through ``ToolInvoker.run`` (argument parsing and schema check, the
   ``execute_tool`` span to a real SDK tracer, timeout, semaphore, rate limit), one call per
   round and 8 per round; medians of ``--rounds`` rounds.
3. Planner: what planning costs per message (it runs on the event loop), and on the labelled
   set (tests/pipeline/tools/planner_cases.py), rules vs nearest-centroid
   over MiniLM embeddings (leave-one-out) vs rules-then-centroid, accuracy of the tool choice.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracer

from pipeline.answer.events import ToolCall
from pipeline.context import Principal
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.calculator import CalculatorError, calculate
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.planner import ToolPlanner
from pipeline.tools.registry import ToolRegistry

EXPRESSIONS = {
    "1234 * 5678": "1234 * 5678",
    "mixed": "(3 + 4) ** 2 / 7 + sqrt(144) - round(2.567, 2) * max(1, 2, 3)",
    "120 terms": " + ".join(["(2*3)"] * 40),
    "2**1000": "2 ** 1000",
    "refused 9**9**9**9": "9**9**9**9",
    "refused ().__class__": "().__class__",
    "refused 600 chars": "1+" * 300,
    "refused (x for x in y)": "(x for x in (1, 2))",
}


def percentiles(samples_ns: Sequence[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p50 = ordered[len(ordered) // 2] / 1000.0
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000.0
    return p50, p99


def bench_calculator(calls: int) -> None:
    print(f"\n## calculator: {calls} calls each, microseconds per call")
    print("| expression | result | p50 us | p99 us |\n| --- | --- | --- | --- |")
    for label, expression in EXPRESSIONS.items():
        samples = []
        outcome = ""
        for _ in range(calls):
            started = time.perf_counter_ns()
            try:
                value = calculate(expression)
                outcome = "ok" if not isinstance(value, int) or value < 10**12 else "ok (big)"
            except CalculatorError as exc:
                outcome = f"refused: {str(exc)[:40]}"
            samples.append(time.perf_counter_ns() - started)
        p50, p99 = percentiles(samples)
        print(f"| `{label}` | {outcome} | {p50:.1f} | {p99:.1f} |")


class Discard(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def instant(arguments: dict[str, Any], context: ToolContext) -> str:
    return "ok"


SCHEMA = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 100}},
    "required": ["q"],
    "additionalProperties": False,
}


async def per_call_us(run: Callable[[], Any], calls_per_run: int, runs: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(runs):
        await run()
    return (time.perf_counter_ns() - started) / (runs * calls_per_run) / 1000.0


async def bench_invoker(calls: int, rounds: int) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Discard()))
    tool = Tool("instant", "returns at once", SCHEMA, instant, rate_per_second=1e9)
    invoker = ToolInvoker(ToolRegistry([tool]), provider.get_tracer("bench"))
    untraced = ToolInvoker(ToolRegistry([tool]), NoOpTracer())
    context = ToolContext(Principal("acme", "alice", frozenset({"chat"}), "k"))
    one = [ToolCall("1", "instant", '{"q": "x"}')]
    eight = [ToolCall(str(i), "instant", '{"q": "x"}') for i in range(8)]

    async def bare() -> None:
        await tool.function({"q": "x"}, context)

    variants = {
        "bare await": (bare, 1),
        "invoker, 1 call a round, no-op tracer": (lambda: untraced.run(one, context), 1),
        "invoker, 1 call a round": (lambda: invoker.run(one, context), 1),
        "invoker, 8 calls a round": (lambda: invoker.run(eight, context), 8),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved, so load changes hit every variant alike
        for name, (run, size) in variants.items():
            results[name].append(await per_call_us(run, size, max(1, calls // size)))
    print(f"\n## invoker overhead: median of {rounds} rounds of {calls} calls")
    print("| variant | us per call | overhead vs bare, us |\n| --- | --- | --- |")
    bare_us = statistics.median(results["bare await"])
    for name, samples in results.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.1f} | {median - bare_us:.1f} |")


PLANS = {
    "What is 1234 * 5678?": "What is 1234 * 5678?",
    "What is the capital of France?": "What is the capital of France?",
    "what time is it in Tokyo?": "what time is it in Tokyo?",
    "2000 chars of prose with digits": "The 2 quick brown foxes jump over the lazy dog. " * 42,
    "2000 chars of '1, 1, 1'": "1, " * 700,
}


def bench_plan_cost(calls: int) -> None:
    planner = ToolPlanner({"calculator", "clock", "profile"})
    print(f"\n## planner: {calls} plans each, microseconds per message")
    print("| message | calls planned | p50 us | p99 us |\n| --- | --- | --- | --- |")
    for label, text in PLANS.items():
        samples = []
        for _ in range(calls):
            started = time.perf_counter_ns()
            planned = planner.plan(text)
            samples.append(time.perf_counter_ns() - started)
        p50, p99 = percentiles(samples)
        names = ", ".join(c.name for c in planned) or "none"
        print(f"| {label} | {names} | {p50:.1f} | {p99:.1f} |")


def bench_planner() -> None:
    import numpy as np

    from retrieval import Embedder
    from tests.pipeline.tools.planner_cases import CASES

    def truth(case: Any) -> str:
        _, value, zone, profile = case
        wanted = (
            ("calculator", value is not None),
            ("clock", zone is not None),
            ("profile", profile),
        )
        return "+".join(name for name, on in wanted if on) or "none"

    planner = ToolPlanner({"calculator", "clock", "profile"})
    labels = [truth(c) for c in CASES]
    rules = ["+".join(c.name for c in planner.plan(case[0])) or "none" for case in CASES]
    embedder = Embedder()
    vectors = embedder.embed([case[0] for case in CASES])
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    centroid: list[str] = []
    for i in range(len(CASES)):  # leave-one-out: case i is classified by the others
        others = [j for j in range(len(CASES)) if j != i]
        classes = sorted({labels[j] for j in others})
        means = np.stack(
            [np.mean([vectors[j] for j in others if labels[j] == c], axis=0) for c in classes]
        )
        means /= np.linalg.norm(means, axis=1, keepdims=True)
        centroid.append(classes[int(np.argmax(means @ vectors[i]))])
    hybrid = [r if r != "none" else c for r, c in zip(rules, centroid, strict=True)]
    print(f"\n## planner: {len(CASES)} labelled requests, tool-choice accuracy")
    print("| planner | correct | accuracy |\n| --- | --- | --- |")
    for name, predicted in (
        ("rules", rules),
        ("centroid (LOO)", centroid),
        ("rules, else centroid", hybrid),
    ):
        correct = sum(p == t for p, t in zip(predicted, labels, strict=True))
        print(f"| {name} | {correct}/{len(CASES)} | {correct / len(CASES):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-centroid", action="store_true")
    options = parser.parse_args()
    bench_calculator(options.calls)
    asyncio.run(bench_invoker(options.calls, options.rounds))
    bench_plan_cost(max(1, options.calls // 10))
    if not options.skip_centroid:
        bench_planner()


if __name__ == "__main__":
    main()
