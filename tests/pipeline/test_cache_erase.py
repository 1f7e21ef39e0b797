"""A delete's erasure of cached answers (``ResponseCache.erase``), on a real Redis: every answer
of the tenant goes with its copies, no other tenant's does, and no answer made from an erased
index version is stored after it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.stages.cache import DROP_BATCH, ERASED_AT_LEAST_S, ResponseCache
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
        assert await cache.put(entry, ANSWER, version="v1")
    copies = [f"{cache.alias_prefix}acme:{n}" for n in range(2)]
    for copy in copies:
        assert await cache.copy(ours[0], copy)
    theirs = key("globex")
    assert await cache.put(theirs, ANSWER, version="v1")
    assert await cache.copy(theirs, f"{cache.alias_prefix}globex:0")
    assert len(await names(cache, "acme")) == 3 + 1 + 2  # the entries, one copies' set, copies

    assert await cache.erase("acme", ["v1"]) == 3
    assert await names(cache, "acme") == set()
    assert await cache.get(theirs) == ANSWER, "another tenant's answers stay"
    assert len(await names(cache, "globex")) == 3
    assert await cache.erase("acme", ["v1"]) == 0  # nothing left: again is harmless


async def test_no_answer_made_from_an_erased_version_is_stored_after_the_erasure(
    cache: ResponseCache,
) -> None:
    await cache.erase("acme", ["v1", "v0"])
    late = key("acme")
    # A request that searched v1 before the delete, ending after it.
    assert not await cache.put(late, ANSWER, version="v1")
    assert not await cache.put(late, ANSWER, version="v0")
    assert await cache.get(late) is None
    assert await names(cache, "acme") == set()
    # The version the delete published, and another tenant's v1, are cached as before.
    assert await cache.put(late, ANSWER, version="v2")
    assert await cache.get(late) == ANSWER
    assert await cache.put(key("globex"), ANSWER, version="v1")
    erased = f"{cache.prefix.removesuffix(':')}-erased:acme"
    assert ERASED_AT_LEAST_S - 5 < await cache.kv.client.ttl(erased) <= ERASED_AT_LEAST_S


async def test_an_erasure_larger_than_one_script_removes_everything(
    cache: ResponseCache,
) -> None:
    many = DROP_BATCH * 2 + 7
    pipe = cache.kv.client.pipeline(transaction=False)
    for n in range(many):
        pipe.set(f"{cache.prefix}acme:{n:064x}", b"{}", ex=600)
    await pipe.execute()
    assert await cache.erase("acme", []) == many
    assert await names(cache, "acme") == set()


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
        assert await cache.put(entry, ANSWER, version="v1")
        await over_its_memory(kv.client)  # writes refused, reads go on
        assert await cache.erase("acme", ["v1"]) == 1
        assert await names(cache, "acme") == set()
        await kv.client.config_set("maxmemory", 0)
        assert not await cache.put(entry, ANSWER, version="v1"), "the mark was kept"
    finally:
        await kv.aclose()
        server.stop()
