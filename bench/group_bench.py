"""The concurrent group (features || retrieve || tools) against the same stages one after
another, side by side in one run, with the real stages over a real Redis and a real index.

Workloads:
- example: the issue's example, a feature store that answers in 100 ms and a planned tool that
  takes 150 ms (an external API), with real retrieval over SciFact (1,000 abstracts).
- local: no added delays; real features, real retrieval, the calculator and the clock planned.
- api-tool: real features and retrieval, plus an HTTP tool whose (local) server answers in 40 ms.

    .venv/bin/python -m bench.group_bench [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from app.services import build_search
from app.settings import Settings
from bench.retrieval_data import load_corpus
from pipeline.answer.events import ToolCall
from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.features.store import FeatureStore
from pipeline.model.salt import MemoScope
from pipeline.runner import Concurrent, Runner, Stage
from pipeline.stages.features import LoadFeatures
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.tools import PlannedTools
from pipeline.store.kv import KeyValueStore
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.builtins import builtin_tools
from pipeline.tools.http import HttpTool
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.planner import ToolPlanner
from pipeline.tools.registry import ToolRegistry
from retrieval import Embedder
from tests.support.servers import RedisServer

ALICE = Principal("bench", "alice", frozenset({"chat"}), "k1")
QUESTIONS = [
    "What is 1234 * 5678 and does vitamin D deficiency affect bone density?",
    "What time is it in Tokyo, and how does smoking change lung cancer risk?",
    "Compute (17 + 25) * 3: is obesity linked to type 2 diabetes?",
]


class SlowStore(FeatureStore):
    async def load(self, tenant: str, user: str, **options: Any) -> Any:
        await asyncio.sleep(0.1)
        return await super().load(tenant, user, **options)


def delayed_tool(name: str, seconds: float) -> Tool:
    async def run(arguments: dict[str, Any], context: ToolContext) -> str:
        await asyncio.sleep(seconds)
        return f"{name}: done"

    return Tool(name, f"An external call of {seconds * 1000:.0f} ms.", {"type": "object"}, run)


class FixedPlan:
    def __init__(self, *names: str) -> None:
        self.names = names

    def plan(self, text: str) -> list[ToolCall]:
        return [ToolCall(f"plan-{i}", name, "{}") for i, name in enumerate(self.names)]


def context(question: str) -> RequestContext:
    loop = asyncio.get_running_loop()
    params = ChatParams(model="smollm2", messages=[{"role": "user", "content": question}])
    return RequestContext(
        params=params, credential=None, deadline=loop.time() + 60, principal=ALICE
    )


async def timed(runner: Runner, question: str) -> float:
    started = time.perf_counter()
    await runner.run(context(question))
    return (time.perf_counter() - started) * 1000.0


async def compare(name: str, members: Sequence[Stage], tracer: Any, rounds: int) -> dict[str, Any]:
    inputs = frozenset({"params", "principal"})
    grouped = Runner([Concurrent(*members)], tracer, inputs=inputs)
    serial = Runner(list(members), tracer, inputs=inputs)
    for question in QUESTIONS:  # warm-up: models, connections, index pages
        await timed(grouped, question)
    together: list[float] = []
    apart: list[float] = []
    for number in range(rounds):
        question = QUESTIONS[number % len(QUESTIONS)]
        # Alternate which goes first so neither always gets a warmer cache.
        if number % 2:
            apart.append(await timed(serial, question))
            together.append(await timed(grouped, question))
        else:
            together.append(await timed(grouped, question))
            apart.append(await timed(serial, question))
    group_p50, serial_p50 = statistics.median(together), statistics.median(apart)
    return {
        "workload": name,
        "group_p50": group_p50,
        "serial_p50": serial_p50,
        "ratio": group_p50 / serial_p50,
    }


async def api_server(delay: float) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def main(rounds: int, documents: int) -> None:
    redis = RedisServer()
    redis.start()
    tracer = TracerProvider().get_tracer("bench")
    settings = Settings(
        environment="test",
        redis={"url": redis.url},
        retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-bench-group-")},
    )
    embedder = Embedder()
    embedder.warm_up()
    search = build_search(settings, tracer, embedder, embedder)
    await search.ingest(ALICE.tenant, load_corpus()[:documents])
    kv = KeyValueStore.from_url(redis.url, tracer)
    retrieve = Retrieve(
        search,
        feature_filters={"department": "department"},
        memo_scope=MemoScope(search.access_scope),
    )
    registry = ToolRegistry(builtin_tools(search))
    registry.add(delayed_tool("slow_lookup", 0.15))
    invoker = ToolInvoker(registry, tracer)
    server, port = await api_server(0.04)
    registry.add(
        HttpTool(
            "status_api",
            "A status API (local, answers in 40 ms).",
            f"http://127.0.0.1:{port}/status",
            allow=[f"http://127.0.0.1:{port}/"],
            allow_private=True,
        ).tool()
    )
    rows = [
        await compare(
            "example: features 100 ms, tool 150 ms, real retrieval",
            [
                LoadFeatures(SlowStore(kv), timeout_s=2.0),
                retrieve,
                PlannedTools(FixedPlan("slow_lookup"), invoker),  # type: ignore[arg-type]
            ],
            tracer,
            rounds,
        ),
        await compare(
            "local: real features, retrieval, calculator + clock",
            [
                LoadFeatures(FeatureStore(kv), timeout_s=2.0),
                retrieve,
                PlannedTools(ToolPlanner(registry.tools), invoker),
            ],
            tracer,
            rounds,
        ),
        await compare(
            "api-tool: real features, retrieval, an HTTP tool of 40 ms",
            [
                LoadFeatures(FeatureStore(kv), timeout_s=2.0),
                retrieve,
                PlannedTools(FixedPlan("status_api"), invoker),  # type: ignore[arg-type]
            ],
            tracer,
            rounds,
        ),
    ]
    print(f"{documents} SciFact abstracts indexed; {rounds} rounds per side; medians in ms\n")
    print("| workload | group p50 | one after another p50 | ratio |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['workload']} | {row['group_p50']:.1f} | {row['serial_p50']:.1f} "
            f"| **{row['ratio']:.2f}** |"
        )
    server.close()
    await kv.aclose()
    await search.aclose()
    redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--documents", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.documents))
