"""The concurrent group of the request path (features || retrieve || tools) costs its slowest
member, not the sum, with the real stages over a real Redis and a real index.

The delays stand for a slow feature store and a slow tool (an API behind an HTTP tool): a
feature store that is slow on purpose cannot be had from a real Redis without stopping it, so
the store's ``load`` waits 100 ms first, and the tool is a registered server tool that takes
150 ms. Retrieval is real and fast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from app.path import memo_scope
from pipeline.answer.events import ToolCall
from pipeline.context import ChatParams, Features, Principal, RequestContext
from pipeline.features.store import FeatureStore
from pipeline.runner import Concurrent, Runner
from pipeline.stages.features import LoadFeatures
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.tools import PlannedTools
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.registry import ToolRegistry
from retrieval import Document
from tests.conftest import make_settings

ALICE = Principal("acme", "alice", frozenset({"chat"}), "k1")


class SlowStore(FeatureStore):
    async def load(self, tenant: str, user: str, **options: Any) -> Any:
        await asyncio.sleep(0.1)
        return await super().load(tenant, user, **options)


class PlanSlowLookup:
    available = frozenset({"slow_lookup"})

    def plan(self, text: str, allowed: Collection[str] | None = None) -> list[ToolCall]:
        return [ToolCall("plan-1", "slow_lookup", "{}"), ToolCall("plan-2", "slow_lookup", "{}")]


async def slow_lookup(arguments: dict[str, Any], context: ToolContext) -> str:
    await asyncio.sleep(0.15)
    return "looked up"


SLOW_TOOL = Tool(
    name="slow_lookup",
    description="An external lookup that takes 150 ms.",
    parameters={"type": "object", "properties": {}},
    function=slow_lookup,
    timeout_s=2.0,
)


def context() -> RequestContext:
    params = ChatParams(
        model="smollm2", messages=[{"role": "user", "content": "How do fjords form?"}]
    )
    loop = asyncio.get_running_loop()
    return RequestContext(
        params=params, credential=None, deadline=loop.time() + 30, principal=ALICE
    )


async def test_the_group_costs_its_slowest_member_not_the_sum(make_app, redis_server) -> None:
    async with make_app(make_settings(redis_server.url, "http://127.0.0.1:9")) as harness:
        services = harness.services
        assert services.retrieval is not None
        await services.retrieval.ingest(
            "acme",
            [
                Document("fjord", "Fjords form where glaciers carve deep valleys into the coast."),
                Document("bird", "The kea is a parrot of the Southern Alps."),
            ],
        )
        store = SlowStore(services.kv, prefix=services.settings.redis.key_prefix)
        invoker = ToolInvoker(ToolRegistry([SLOW_TOOL]), services.tracer)
        members = (
            LoadFeatures(store, timeout_s=2.0),
            Retrieve(
                services.retrieval,
                feature_filters={"department": "department"},
                memo_scope=memo_scope(services),
            ),
            PlannedTools(PlanSlowLookup(), invoker),  # type: ignore[arg-type]
        )
        inputs = frozenset({"params", "principal"})
        await Runner([members[1]], services.tracer, inputs=inputs | {"features"}).run(context())

        loop = asyncio.get_running_loop()
        started = loop.time()
        grouped = await Runner([Concurrent(*members)], services.tracer, inputs=inputs).run(
            context()
        )
        together = loop.time() - started
        started = loop.time()
        await Runner(list(members), services.tracer, inputs=inputs).run(context())
        one_after_another = loop.time() - started

        records = {r.name: r for r in grouped.records}
        assert records["features"].duration_ms >= 100
        assert records["tools"].duration_ms >= 150
        assert records["retrieve"].status == "ok" and grouped.passages
        assert [run.status for run in grouped.tool_runs] == ["ok", "ok"]
        assert isinstance(grouped.features, Features)
        # The members ran at once: each started before any had ended (retrieval waits for the
        # features only to merge their filter). So the group costs about its slowest member
        # (150 ms), not the sum (250 ms); the times are printed, not bounded, since a busy
        # machine stretches both.
        members_ran = [records[name] for name in ("features", "retrieve", "tools")]
        last_start = max(r.start_ms for r in members_ran)
        first_end = min(r.start_ms + r.duration_ms for r in members_ran)
        assert last_start < first_end, [(r.name, r.start_ms, r.duration_ms) for r in members_ran]
        assert one_after_another >= 0.25, one_after_another
        print(f"group {together * 1000:.0f} ms, in a row {one_after_another * 1000:.0f} ms")
