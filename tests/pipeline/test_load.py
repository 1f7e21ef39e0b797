"""Adapting to a loaded route (``pipeline.routing.load``, ``pipeline.stages.adapt``): the
pressure a route's slots report, the steps it leads to, and what the adapt stage changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pipeline.context import ChatParams, Principal, RagOptions, RequestContext
from pipeline.model.client import LLMClient
from pipeline.model.routes import Route, RouteTable
from pipeline.model.slots import SlotPool
from pipeline.routing.load import COMPRESS, SMALL_ROUTE, TOP_K, LoadPolicy, pressure
from pipeline.stages.adapt import AdaptToLoad


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_steps_start_at_their_pressure_each_on_top_of_the_last() -> None:
    policy = LoadPolicy()
    assert policy.steps(0.0) == () and policy.steps(0.74) == ()
    assert policy.steps(0.75) == (TOP_K,)
    assert policy.steps(1.0) == (TOP_K, COMPRESS)
    assert policy.steps(1.5) == (TOP_K, COMPRESS, SMALL_ROUTE)


def test_steps_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError):
        LoadPolicy(top_k_at=1.0, compress_at=0.5)


async def test_pressure_counts_held_and_queued_calls_and_the_tenants_own_share() -> None:
    pool = SlotPool(4, 2)
    assert pool.pressure() == 0.0
    await pool.acquire("a")
    await pool.acquire("b")
    assert pool.pressure() == 0.5
    assert pool.pressure("a") == 0.5  # one of a's two
    await pool.acquire("a")
    assert pool.pressure("a") == 1.0 and pool.pressure("c") == 0.75
    waiter = asyncio.create_task(pool.acquire("a"))
    await settle()
    assert pool.pressure() == 1.0 and pool.pressure("a") == 1.5
    waiter.cancel()
    await settle()
    assert pool.pressure() == 0.75


@pytest.fixture
async def routes() -> AsyncIterator[RouteTable]:
    table = RouteTable(
        {
            name: Route(name, "smollm2", LLMClient("http://127.0.0.1:9"), SlotPool(4, name=name))
            for name in ("small", "large")
        }
    )
    yield table
    await table.aclose()


def context(**rag: object) -> RequestContext:
    params = ChatParams(
        model="auto",
        messages=[{"role": "user", "content": "What is vitamin D?"}],
        rag=RagOptions(**rag),  # type: ignore[arg-type]
    )
    ctx = RequestContext(params=params, credential=None, deadline=time.monotonic() + 30)
    ctx.principal = Principal("acme", "alice", frozenset({"chat"}), "k1")
    return ctx


async def test_free_slots_leave_the_request_as_asked(routes: RouteTable) -> None:
    stage = AdaptToLoad(routes, LoadPolicy(), budget_tokens=384)
    ctx = await stage(context(top_k=8, compress=False))
    assert ctx.params.rag.top_k == 8 and ctx.params.rag.compress is False
    assert not ctx.cache_control.no_store


async def test_most_slots_taken_fewer_sources_and_the_answer_is_not_stored(
    routes: RouteTable,
) -> None:
    for _ in range(3):
        await routes.get("large").slots.acquire("other")
    stage = AdaptToLoad(routes, LoadPolicy(), budget_tokens=384)
    ctx = await stage(context(top_k=8, compress=False))
    assert ctx.params.rag.top_k == 2 and ctx.params.rag.compress is False
    assert ctx.cache_control.no_store


async def test_every_slot_taken_also_compresses_to_the_tighter_budget(routes: RouteTable) -> None:
    for _ in range(4):
        await routes.get("small").slots.acquire("other")
    stage = AdaptToLoad(routes, LoadPolicy(), budget_tokens=384)
    ctx = await stage(context(top_k=8, compress=False))
    assert ctx.params.rag.top_k == 2
    assert ctx.params.rag.compress is True and ctx.params.rag.budget_tokens == 192
    # A request already asking for less keeps what it asked.
    small = await stage(context(top_k=1, budget_tokens=100))
    assert small.params.rag.top_k == 1 and small.params.rag.budget_tokens == 100
    assert not small.cache_control.no_store


async def test_a_request_pinned_to_a_free_route_is_not_adapted(routes: RouteTable) -> None:
    for _ in range(4):
        await routes.get("large").slots.acquire("other")
    stage = AdaptToLoad(routes, LoadPolicy(), budget_tokens=384)
    ctx = await stage(context(top_k=8, route="small"))
    assert ctx.params.rag.top_k == 8
    assert pressure([routes.get("small")], "acme") == 0.0
