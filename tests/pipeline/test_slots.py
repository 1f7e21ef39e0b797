"""A route's slots (``pipeline.model.slots``): each tenant bounded, the queue served in turns
among tenants and in arrival order within one, a caller refused with a 503 and ``Retry-After``
when its deadline comes first, and no slot lost to a caller cancelled or failing."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import ClientClosedRequest, UpstreamBusy
from pipeline.model.slots import GIVE_UP_BEFORE_S, SlotPool, caller_left


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_tenant_holds_no_more_than_its_share_while_others_take_the_rest() -> None:
    pool = SlotPool(4, 2)
    await pool.acquire("a")
    await pool.acquire("a")
    third = asyncio.create_task(pool.acquire("a"))
    await settle()
    assert not third.done(), "a third slot went to a tenant bounded at two"
    assert await asyncio.wait_for(pool.acquire("b"), 1) == 0.0, "another tenant had to wait"
    assert (pool.held_by("a"), pool.held_by("b"), pool.waiting) == (2, 1, 1)
    pool.release("a")
    await asyncio.wait_for(third, 1)
    assert pool.held_by("a") == 2


async def test_freed_slots_go_to_tenants_in_turn_and_to_each_tenants_callers_in_order() -> None:
    pool = SlotPool(1)
    await pool.acquire("holder")
    served: list[str] = []

    async def caller(tenant: str, name: str) -> None:
        await pool.acquire(tenant)
        served.append(name)

    tasks = []
    for tenant, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")]:
        tasks.append(asyncio.create_task(caller(tenant, name)))
        await settle()  # queued in this order
    assert pool.waiting == 5
    pool.release("holder")
    for _ in range(5):
        await settle()
        last = served[-1]
        pool.release(last[0])
    await asyncio.gather(*tasks)
    # Tenant a came first with three callers; b and c each get a turn between a's callers.
    assert served == ["a1", "b1", "c1", "a2", "a3"]
    assert (pool.in_use, pool.waiting) == (0, 0)


async def test_a_caller_whose_deadline_comes_first_gets_a_503_with_retry_after() -> None:
    pool = SlotPool(1, name="small")
    async with pool.slot("a"):
        await asyncio.sleep(0.05)  # a hold time for the estimate
    await pool.acquire("a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + GIVE_UP_BEFORE_S + 0.3
    with pytest.raises(UpstreamBusy) as refused:
        await pool.acquire("b", deadline)
    ended = loop.time()
    assert deadline - GIVE_UP_BEFORE_S - 0.01 <= ended < deadline, "did not queue up to it"
    error = refused.value
    assert error.status_code == 503
    assert error.to_dict() == {
        "error": {
            "message": error.message,
            "type": "service_unavailable",
            "param": None,
            "code": "upstream_busy",
        }
    }
    assert "'small'" in error.message
    assert int(error.headers["Retry-After"]) >= 1
    assert (pool.in_use, pool.waiting) == (1, 0), "the refused caller stayed queued"
    # A deadline already (nearly) past is refused at once rather than queued.
    with pytest.raises(UpstreamBusy):
        await asyncio.wait_for(pool.acquire("b", loop.time() + GIVE_UP_BEFORE_S / 2), 0.05)


async def test_a_cancelled_caller_leaves_the_queue_and_takes_no_slot() -> None:
    pool = SlotPool(1)
    await pool.acquire("a")
    waiting = asyncio.create_task(pool.acquire("b"))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.waiting == 0
    pool.release("a")
    assert (pool.in_use, pool.waiting) == (0, 0)
    assert await asyncio.wait_for(pool.acquire("b"), 1) == 0.0


async def test_a_slot_granted_to_a_caller_cancelled_at_that_moment_is_passed_on() -> None:
    pool = SlotPool(1)
    await pool.acquire("holder")
    first = asyncio.create_task(pool.acquire("a"))
    second = asyncio.create_task(pool.acquire("b"))
    await settle()
    pool.release("holder")  # granted to a's caller ...
    first.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert (pool.held_by("a"), pool.held_by("b"), pool.in_use) == (0, 1, 1)


async def test_a_slot_is_released_when_its_holder_fails() -> None:
    pool = SlotPool(2, 1)
    with pytest.raises(RuntimeError):
        async with pool.slot("a"):
            assert pool.held_by("a") == 1
            raise RuntimeError("the model call failed")
    assert (pool.in_use, pool.held_by("a")) == (0, 0)


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        SlotPool(0)
    with pytest.raises(ValueError):
        SlotPool(2, 0)
    assert SlotPool(2, 5).per_tenant == 2
    assert SlotPool(3).per_tenant == 3


async def queued_with(
    pool: SlotPool, tenant: str, left: asyncio.Future[None]
) -> asyncio.Task[float]:
    """A call of ``tenant`` queued for a slot by a request whose caller leaves when ``left``
    resolves (as ``app.http.disconnect`` sets it)."""

    async def leaving() -> None:
        await left

    token = caller_left.set(leaving)
    try:
        task = asyncio.create_task(pool.acquire(tenant))  # the task keeps a copy of the context
    finally:
        caller_left.reset(token)
    await settle()
    return task


async def test_a_queued_caller_that_leaves_leaves_the_queue_with_a_499_and_takes_no_slot() -> None:
    pool = SlotPool(1)
    await pool.acquire("holder")
    left: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gone = await queued_with(pool, "a", left)
    stays = asyncio.create_task(pool.acquire("b"))  # no signal: waits as before
    await settle()
    assert pool.waiting == 2
    left.set_result(None)
    with pytest.raises(ClientClosedRequest) as caught:
        await asyncio.wait_for(gone, 1)
    assert caught.value.status_code == 499 and caught.value.code == "client_closed_request"
    assert pool.waiting == 1 and pool.held_by("a") == 0
    pool.release("holder")
    await asyncio.wait_for(stays, 1)
    assert (pool.held_by("b"), pool.in_use, pool.waiting) == (1, 1, 0)


async def test_a_caller_that_stays_gets_its_slot_and_a_failed_watch_is_no_leaving() -> None:
    pool = SlotPool(1)
    await pool.acquire("holder")
    stays: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    served = await queued_with(pool, "a", stays)
    pool.release("holder")
    assert await asyncio.wait_for(served, 1) >= 0.0
    assert pool.held_by("a") == 1 and pool.waiting == 0
    pool.release("a")

    # A watch that fails has seen nothing: the call waits on for its turn.
    await pool.acquire("holder")
    broken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = await queued_with(pool, "a", broken)
    broken.set_exception(RuntimeError("no such message"))
    await settle()
    assert not waiting.done() and pool.waiting == 1
    pool.release("holder")
    await asyncio.wait_for(waiting, 1)
    assert pool.held_by("a") == 1


async def test_a_caller_that_finds_a_free_slot_never_starts_the_watch() -> None:
    pool = SlotPool(1)
    watched: list[bool] = []

    async def leaving() -> None:
        watched.append(True)

    token = caller_left.set(leaving)
    try:
        assert await pool.acquire("a") == 0.0
    finally:
        caller_left.reset(token)
    assert watched == [] and pool.held_by("a") == 1
