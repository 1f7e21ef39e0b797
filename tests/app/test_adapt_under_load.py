"""Graceful under load, through the service against the real vLLM: with the routes' slots held
(a small ``max_concurrency``, slots taken by another tenant and callers queued behind them) a
request is answered with fewer, compressed sources on the small route, and ``rag.explain``, the
span and ``rag_adapted_total`` say so; with the slots free nothing is adapted; with adaptation
switched off the same request waits for the loaded route and is refused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import REGISTRY

from pipeline.model.slots import SlotPool
from tests.app.test_source_budget import scifact_documents
from tests.conftest import chat_request, make_settings

NO_CACHE = {"Cache-Control": "no-cache"}
# The router's rules send a step-by-step question to the large route.
QUESTION = "Explain step by step how T cells recognise and kill tumour cells."


def settings(redis_url: str, llm_url: str, timeout_s: float = 60.0, **adapt: Any) -> Any:
    route = {"base_url": llm_url, "model": "smollm2", "max_concurrency": 4}
    return make_settings(
        redis_url,
        llm_url,
        routing={"routes": {"small": route, "large": route}},
        server={"request_timeout_seconds": timeout_s},
        adapt=adapt,
    )


def stage_info(response: Any, name: str) -> dict[str, Any]:
    stages = response.json()["rag"]["explain"]["stages"]
    return next(s for s in stages if s["name"] == name).get("info", {})


def adapted_total(step: str) -> float:
    return REGISTRY.get_sample_value("rag_adapted_total", {"step": step}) or 0.0


@contextlib.asynccontextmanager
async def loaded(pool: SlotPool, queued: int) -> AsyncIterator[None]:
    """Every slot of ``pool`` held by another tenant, and ``queued`` callers waiting."""
    for _ in range(pool.capacity):
        await pool.acquire("other")
    waiters = [asyncio.create_task(pool.acquire("other")) for _ in range(queued)]
    for _ in range(5):
        await asyncio.sleep(0)
    try:
        yield
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for _ in range(pool.in_use):
            pool.release("other")


async def ingest(harness: Any) -> str:
    writer = await harness.key(scopes="chat,retrieve,ingest")
    response = await harness.client.post(
        "/v1/documents",
        json={"documents": scifact_documents(12)},
        headers={"Authorization": f"Bearer {writer}"},
    )
    assert response.status_code == 200, response.text
    return await harness.key()


def body() -> dict[str, Any]:
    return chat_request(
        QUESTION,
        model="auto",
        rag={"top_k": 4, "compress": False, "explain": True, "min_relevance": 0.0},
    )


async def test_with_free_slots_nothing_is_adapted(make_app, redis_server, vllm) -> None:
    async with make_app(settings(redis_server.url, vllm.url)) as harness:
        key = await ingest(harness)
        response = await harness.chat(key, body(), **NO_CACHE)
        assert response.status_code == 200, response.text
        info = stage_info(response, "adapt")
        assert info["adapt.pressure"] == 0.0 and "adapt.steps" not in info
        assert len(response.json()["rag"]["sources"]) == 4
        assert stage_info(response, "compress")["compress.skipped"] == "off"
        route = response.json()["rag"]["route"]
        assert route["name"] == "large" and "adapted" not in route["reason"]


async def test_with_the_route_full_and_queued_the_request_asks_for_less_and_says_so(
    make_app, redis_server, vllm
) -> None:
    async with make_app(settings(redis_server.url, vllm.url)) as harness:
        key = await ingest(harness)
        before = {s: adapted_total(s) for s in ("top_k", "compress", "small_route")}
        large = harness.services.routes.get("large").slots
        async with loaded(large, queued=2):  # pressure 1.5: every step
            response = await harness.chat(key, body(), **NO_CACHE)
        assert response.status_code == 200, response.text
        rag = response.json()["rag"]
        adapt = stage_info(response, "adapt")
        assert adapt["adapt.pressure"] == 1.5
        assert adapt["adapt.steps"] == ["top_k", "compress"]
        assert adapt["adapt.top_k"] == 2 and adapt["adapt.budget_tokens"] == 192
        assert len(rag["sources"]) <= 2
        assert stage_info(response, "compress")["compress.budget"] == 192
        route = stage_info(response, "route")
        assert route["adapt.route"] == "large->small" and route["adapt.steps"] == ["small_route"]
        assert rag["route"]["name"] == "small" and rag["route"]["reason"].endswith("adapted:load")
        for step in before:
            assert adapted_total(step) == before[step] + 1, step
        spans = {s.name: s for s in harness.exporter.get_finished_spans()}
        assert spans["stage adapt"].attributes["rag.adapt.steps"] == ("top_k", "compress")
        # An adapted answer is not stored: the same request, the slots free, is a miss.
        again = await harness.chat(key, body())
        assert again.json()["rag"]["cache"] == "miss"
        assert len(again.json()["rag"]["sources"]) == 4


async def test_most_slots_taken_only_fewer_sources(make_app, redis_server, vllm) -> None:
    async with make_app(settings(redis_server.url, vllm.url)) as harness:
        key = await ingest(harness)
        small = harness.services.routes.get("small").slots
        for _ in range(3):
            await small.acquire("other")
        try:
            response = await harness.chat(key, body(), **NO_CACHE)
        finally:
            for _ in range(3):
                small.release("other")
        assert response.status_code == 200, response.text
        adapt = stage_info(response, "adapt")
        assert adapt["adapt.steps"] == ["top_k"] and "adapt.budget_tokens" not in adapt
        assert stage_info(response, "compress")["compress.skipped"] == "off"
        assert response.json()["rag"]["route"]["name"] == "large"


async def test_switched_off_the_request_waits_for_the_loaded_route_and_is_refused(
    make_app, redis_server, vllm
) -> None:
    async with make_app(
        settings(redis_server.url, vllm.url, timeout_s=4.0, enabled=False)
    ) as harness:
        key = await ingest(harness)
        large = harness.services.routes.get("large").slots
        async with loaded(large, queued=2):
            response = await harness.chat(key, body(), **NO_CACHE)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "upstream_busy"
