"""A delete's erasure of cached answers (``ResponseCache.erase``), on a real Redis: every answer
of the tenant goes with its copies, no other tenant's does, and no answer made from an erased
index version is stored after it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.errors import StoreUnavailable
from pipeline.stages.cache import DROP_BATCH, ERASED_AT_LEAST_S, PRUNE_STEP, ResponseCache
from pipeline.store.kv import KeyValueStore

ANSWER = Completion(model="smollm2", content="The kiwi lays a large egg.", finish_reason="stop")


@pytest.fixture
async def cache(redis_server) -> AsyncIterator[ResponseCache]:
    kv = KeyValueStore.from_url(redis_server.url, trace.get_tracer("test"), timeout=10.0)
    made = ResponseCache(kv, ttl=600, prefix=f"erase{uuid.uuid4().hex[:8]}:cache:")
    try:
        yield made
    finally:
        names = await kv.scan(made.prefix.removesuffix("cache:") + "*")
        for name in names:
            await kv.delete(name.decode())
        await kv.aclose()


def key(tenant: str) -> str:
    return f"{tenant}:{uuid.uuid4().hex}"


async def names(cache: ResponseCache, tenant: str) -> set[str]:
    """Every name of the tenant's answers and their copies."""
    found = await cache.kv.scan(f"{cache.prefix}{tenant}:*")
    found += await cache.kv.scan(f"{cache.alias_prefix}{tenant}:*")
    return {n.decode() for n in found}


async def test_erase_removes_every_answer_of_the_tenant_with_its_copies_and_no_other(
    cache: ResponseCache,
) -> None:
    ours = [key("acme") for _ in range(3)]
    for entry in ours:
        assert await cache.put(entry, ANSWER, version="00000001-aaaaaa")
    copies = [f"{cache.alias_prefix}acme:{n}" for n in range(2)]
    for copy in copies:
        assert await cache.copy(ours[0], copy)
    theirs = key("globex")
    assert await cache.put(theirs, ANSWER, version="00000001-aaaaaa")
    assert await cache.copy(theirs, f"{cache.alias_prefix}globex:0")
    assert len(await names(cache, "acme")) == 3 + 1 + 2  # the entries, one copies' set, copies

    assert await cache.erase("acme", "00000002-bbbbbb") == 3
    assert await names(cache, "acme") == set()
    assert await cache.get(theirs) == ANSWER, "another tenant's answers stay"
    assert len(await names(cache, "globex")) == 3
    assert await cache.erase("acme", "00000002-bbbbbb") == 0  # again: harmless


async def test_no_answer_made_from_a_version_before_the_delete_is_stored_after_it(
    cache: ResponseCache,
) -> None:
    # The delete published version 4: 3 held the document, and 1, pruned from disk long ago,
    # may still be what a slow request searched (a review's reproducer: 1 was stored).
    await cache.erase("acme", "00000004-dddddd")
    late = key("acme")
    for before in ("00000003-cccccc", "00000001-aaaaaa", "3", "0"):
        assert not await cache.put(late, ANSWER, version=before), before
    assert await cache.get(late) is None
    assert await names(cache, "acme") == set()
    # The version the delete published and those after it are cached as before, and so is a
    # version with no number (an index that is off), and another tenant's version 1.
    for after in ("00000004-dddddd", "00000005-eeeeee", "12", "none", ""):
        assert await cache.put(late, ANSWER, version=after), after
    assert await cache.get(late) == ANSWER
    assert await cache.put(key("globex"), ANSWER, version="00000001-aaaaaa")
    # A mark never goes down (an older delete's, told late), and lasts at least an hour.
    await cache.erase("acme", "00000002-bbbbbb")
    assert not await cache.put(late, ANSWER, version="00000003-cccccc")
    mark = f"{cache.prefix.removesuffix(':')}-erased:acme"
    assert await cache.kv.get(mark) == b"4"
    assert ERASED_AT_LEAST_S - 5 < await cache.kv.client.ttl(mark) <= ERASED_AT_LEAST_S


async def test_a_tenant_named_as_a_digest_erases_only_its_own_answers(
    cache: ResponseCache,
) -> None:
    # A tenant's name may be 64 hex digits: the walk's pattern then also matches another
    # tenant's entry whose digest it is (a review's reproducer dropped it).
    digest = "ab" * 32
    theirs = f"victim:{digest}"
    assert await cache.put(theirs, ANSWER)
    assert await cache.copy(theirs, f"{cache.alias_prefix}victim:{digest}")
    assert await cache.put(f"{digest}:{'0' * 64}", ANSWER)
    assert await cache.erase(digest, "") == 1
    assert await cache.get(theirs) == ANSWER
    assert len(await names(cache, "victim")) == 3


async def test_an_erasure_larger_than_one_script_removes_everything(
    cache: ResponseCache,
) -> None:
    many = DROP_BATCH * 2 + 7
    await asyncio.gather(*(cache.put(key("acme"), ANSWER) for _ in range(many)))
    assert await cache.erase("acme", "") == many
    assert await names(cache, "acme") == set()
    assert not await cache.kv.client.exists(entries_of(cache, "acme")), "its names went too"
    assert not await cache.kv.scan(f"{cache.prefix.removesuffix(':')}-erasing:*")


def entries_of(cache: ResponseCache, tenant: str) -> str:
    return f"{cache.prefix.removesuffix(':')}-entries:{tenant}"


async def test_an_erasure_reads_the_tenants_entries_not_the_keyspace(
    cache: ResponseCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its cost is the tenant's answers: a walk of every key Redis holds took about a second
    # per million keys (bench.cache_erase).
    ours = [key("acme") for _ in range(5)]
    for entry in ours:
        assert await cache.put(entry, ANSWER)
    theirs = key("globex")
    assert await cache.put(theirs, ANSWER)

    async def no_walk(*args: object, **kwargs: object) -> list[bytes]:
        raise AssertionError("an erasure walked the keyspace")

    monkeypatch.setattr(cache.kv, "scan", no_walk)
    assert await cache.erase("acme", "00000002-bbbbbb") == 5
    monkeypatch.undo()
    assert await names(cache, "acme") == set()
    assert await cache.get(theirs) == ANSWER


async def test_the_tenants_entries_hold_the_live_answers_and_expire_with_them(
    cache: ResponseCache,
) -> None:
    index = entries_of(cache, "acme")
    client = cache.kv.client
    lasting = key("acme")
    assert await cache.put(lasting, ANSWER, ttl=60)
    short = [key("acme") for _ in range(PRUNE_STEP + 3)]
    for entry in short:
        assert await cache.put(entry, ANSWER, ttl=1)
    assert await client.zcard(index) == 1 + len(short)
    assert 59_000 < await client.pttl(index) <= 60_000, "as long as its longest-lived entry"
    await asyncio.sleep(1.2)  # the short entries have expired; their names are still there
    late = key("acme")
    assert await cache.put(late, ANSWER, ttl=60)
    # A put drops at most PRUNE_STEP expired names, so none pays for a long backlog; the next
    # drops the rest, and the set names the live entries alone.
    assert await client.zcard(index) == 1 + len(short) - PRUNE_STEP + 1
    assert await cache.put(late, ANSWER, ttl=60)  # the same entry again: named once
    live = {entry.rpartition(":")[2].encode() for entry in (lasting, late)}
    assert set(await client.zrange(index, 0, -1)) == live
    assert await cache.erase("acme", "") == 2
    # And the set goes with its last entry when puts stop.
    assert await cache.put(key("acme"), ANSWER, ttl=1)
    await asyncio.sleep(1.1)
    assert not await client.exists(index)


async def test_answers_stored_while_the_sweep_runs_are_left_and_it_ends(
    cache: ResponseCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep takes what the tenant had named when it began. Answers stored while it runs
    # were made from the version the delete published (older ones are refused): they stay, and
    # a tenant storing them as fast as the sweep drops cannot keep it going.
    old = [key("acme") for _ in range(DROP_BATCH * 3)]
    await asyncio.gather(*(cache.put(entry, ANSWER, version="00000001-a") for entry in old))
    run_script, new = cache.kv.run_script, []

    async def store_one_between(name: str, *args: Any) -> Any:
        if name == "cache_drop":
            new.append(key("acme"))
            assert await cache.put(new[-1], ANSWER, version="00000002-b")
            assert not await cache.put(key("acme"), ANSWER, version="00000001-a")
        return await run_script(name, *args)

    monkeypatch.setattr(cache.kv, "run_script", store_one_between)
    assert await cache.erase("acme", "00000002-b") == len(old)
    monkeypatch.undo()
    assert len(new) == 3
    assert not any([await cache.kv.client.exists(cache.prefix + e) for e in old])
    assert all([await cache.get(e) == ANSWER for e in new])
    assert await cache.erase("acme", "00000003-c") == len(new)


async def test_a_sweep_that_failed_part_way_is_finished_by_the_next_erasure(
    cache: ResponseCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A review's reproducer: the names left under a sweep's own random name were read by no
    # later erasure, and their answers stayed for their TTL.
    entries = [key("acme") for _ in range(DROP_BATCH * 3)]
    await asyncio.gather(*(cache.put(e, ANSWER, version="00000001-a") for e in entries))
    run_script, drops = cache.kv.run_script, 0

    async def second_drop_fails(name: str, *args: Any) -> Any:
        nonlocal drops
        if name == "cache_drop":
            drops += 1
            if drops == 2:  # a timeout, a dropped connection, a failover
                raise StoreUnavailable("redis EVALSHA cache_drop: TimeoutError")
        return await run_script(name, *args)

    monkeypatch.setattr(cache.kv, "run_script", second_drop_fails)
    with pytest.raises(StoreUnavailable):
        await cache.erase("acme", "00000002-b")
    monkeypatch.undo()
    later = key("acme")
    assert await cache.put(later, ANSWER, version="00000002-b")
    assert await cache.erase("acme", "00000003-c") == len(entries) - DROP_BATCH + 1
    assert await names(cache, "acme") == set()


async def test_a_second_erasure_returns_once_the_first_ones_answers_are_gone(
    cache: ResponseCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two deletes at once (two replicas): the second found the names taken and answered 0 at
    # once, while the first had yet to drop them (a review's reproducer).
    entries = [key("acme") for _ in range(DROP_BATCH * 3)]
    await asyncio.gather(*(cache.put(e, ANSWER, version="00000001-a") for e in entries))
    run_script, paused, go = cache.kv.run_script, asyncio.Event(), asyncio.Event()

    async def first_sweep_held(name: str, *args: Any) -> Any:
        if name == "cache_drop" and not go.is_set():
            paused.set()
            await go.wait()
        return await run_script(name, *args)

    monkeypatch.setattr(cache.kv, "run_script", first_sweep_held)
    first = asyncio.create_task(cache.erase("acme", "00000002-b"))
    await paused.wait()
    monkeypatch.setattr(cache.kv, "run_script", run_script)
    assert await cache.erase("acme", "00000003-c") == len(entries)
    assert await names(cache, "acme") == set()
    go.set()
    assert await first == 0


async def test_an_erasure_runs_whole_while_redis_is_out_of_memory() -> None:
    # The marks are a write Redis would refuse at its limit (noeviction), and the sweep only
    # deletes: both run, so a delete made while Redis is full still erases (and frees room).
    from tests.support.servers import RedisServer, over_its_memory

    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, trace.get_tracer("test"), timeout=10.0)
    try:
        cache = ResponseCache(kv, ttl=600)
        entry = key("acme")
        assert await cache.put(entry, ANSWER, version="00000001-aaaaaa")
        await over_its_memory(kv.client)  # writes refused, reads go on
        assert await cache.erase("acme", "00000002-bbbbbb") == 1
        assert await names(cache, "acme") == set()
        await kv.client.config_set("maxmemory", 0)
        assert not await cache.put(entry, ANSWER, version="00000001-aaaaaa"), "the mark was kept"
    finally:
        await kv.aclose()
        server.stop()


async def test_a_cluster_no_node_of_which_answers_is_unavailable_not_an_error() -> None:
    # redis-py's cluster errors are not RedisErrors: a delete's erasure let one through, and
    # the published delete answered a 500 (a review's reproducer).
    from tests.support.servers import free_port

    kv = KeyValueStore.from_url(
        f"redis://127.0.0.1:{free_port()}/0", trace.get_tracer("test"), timeout=2.0, cluster=True
    )
    try:
        with pytest.raises(StoreUnavailable):
            await kv.get("anything")
        with pytest.raises(StoreUnavailable):
            await ResponseCache(kv).erase("acme", "00000002-bbbbbb")
    finally:
        await kv.aclose()
