"""The service on a real Redis Cluster (``RAG_REDIS__CLUSTER=true``): three primaries of the
tests' own, the slots split between them.

Every script and transaction of the service uses keys of one slot, or the cluster refuses it
(CROSSSLOT): keys, the cache and its fast-path aliases, coalesced flights, rate limits, features,
jobs, index versions and backend moves each run here through their real code, so a name
without its hash tag fails its test. Keys are spread over the nodes (a scan visits each), and
a node that lost its scripts costs one pipeline, not every later one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from opentelemetry import trace
from pydantic import ValidationError

from app.settings import Settings
from pipeline.context import Principal
from pipeline.errors import StoreUnavailable
from pipeline.features.store import FeatureRow, FeatureStore
from pipeline.jobs.model import SUCCEEDED
from pipeline.jobs.queue import JobQueue
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from pipeline.store.limits import LimitConfig, RateLimiter, tenant_record
from pipeline.store.singleflight import SingleFlight
from retrieval.backends.router import RedisOverrides
from retrieval.backends.versions import RedisVersions
from tests.app.test_coalescing import ask, content, flights_of, generations, roles
from tests.app.test_fastpath import served_fast
from tests.conftest import AppHarness, make_settings, unique_question
from tests.pipeline.jobs.conftest import make_job
from tests.support.servers import RedisClusterServers, wait_for


def on_cluster(cluster: RedisClusterServers, llm_url: str, **groups: dict[str, Any]) -> Settings:
    # Routing and features off, as the coalescing tests have them: a degraded stage would
    # make an answer that is neither cached nor shared (see tests.app.test_coalescing).
    return make_settings(
        cluster.url,
        llm_url,
        redis={"cluster": True, "timeout_seconds": 2.0},
        routing={"enabled": False},
        features={"enabled": False},
        **groups,
    )


@pytest.fixture
async def kv(redis_cluster: RedisClusterServers) -> AsyncIterator[KeyValueStore]:
    store = KeyValueStore.from_url(redis_cluster.url, trace.NoOpTracer(), timeout=5.0, cluster=True)
    yield store
    await store.aclose()


def node_of(cluster: RedisClusterServers, key: str) -> int:
    """The port of the primary that holds ``key``'s slot."""
    client = redis.RedisCluster.from_url(cluster.url)
    try:
        return int(client.get_node_from_key(key).port)
    finally:
        client.close()


# Limits on: every request runs the limits' script on five keys of its tenant's slot.
LIMITED = {"key_rpm": 100_000, "tenant_rpm": 100_000}


async def cached_answers(h: AppHarness, count: int = 4) -> tuple[str, list[dict[str, Any]]]:
    """A key of tenant acme and ``count`` questions, each answered, then a hit (the hit gives
    its body a fast-path alias)."""
    key = await h.key("acme")
    bodies = [ask(unique_question()) for _ in range(count)]
    for body in bodies:
        assert (await h.chat(key, body)).headers["x-cache"] == "miss"
        assert (await h.chat(key, body)).headers["x-cache"] == "hit"
    return key, bodies


async def hits_again(h: AppHarness, key: str, bodies: list[dict[str, Any]]) -> None:
    """Each body a hit again within 10 s (its entry's node back or replaced), never refused
    meanwhile: the key was seen a moment ago (a 503 "circuit open" in 2 of 10 runs of the
    failover test when the key cache was cleared at the change channel's return)."""
    for body in bodies:
        for _ in range(40):
            again = await h.chat(key, body)
            assert again.status_code == 200, again.text
            if again.headers["x-cache"] == "hit":
                break
            await asyncio.sleep(0.25)
        assert again.headers["x-cache"] == "hit"


async def test_a_key_answers_from_the_cache_and_the_fast_path_and_is_refused_once_revoked(
    make_app, redis_cluster, vllm
) -> None:
    async with make_app(on_cluster(redis_cluster, vllm.url)) as h:
        h: AppHarness
        assert h.services.kv.cluster
        key = await h.key("acme")
        body = ask(unique_question())
        first = await h.chat(key, body)
        assert first.headers["x-cache"] == "miss", first.text
        again = await h.chat(key, body)
        assert again.headers["x-cache"] == "hit"
        # The hit gave the body an alias (a script that copies the entry beside it), which the
        # fast path then answers from.
        fast = await h.chat(key, body)
        assert served_fast(h, fast) and content(fast) == content(first)

        listed = await h.services.keys.keys_of("acme", rescan=True)  # SCAN on every primary
        assert len(listed) == 1
        await h.services.keys.revoke(key)
        for _ in range(40):  # the revocation reaches the cache over pub/sub
            refused = await h.chat(key, body)
            if refused.status_code == 401:
                break
            await asyncio.sleep(0.1)
        assert refused.status_code == 401, refused.text


async def test_identical_streams_on_two_replicas_make_one_generation_per_prompt(
    make_app, redis_cluster, vllm
) -> None:
    settings = on_cluster(redis_cluster, vllm.url)
    async with make_app(settings) as one, make_app(settings) as two:
        key = await one.key("coalesce")
        tag = unique_question()[-11:]
        prompts = [f"Say the word {word}. {tag}" for word in ("apple", "river", "candle")]
        answers = await asyncio.gather(
            *(
                (one, two)[i % 2].client.post(
                    "/v1/chat/completions",
                    json=ask(prompts[i % 3], stream=True),
                    headers={"Authorization": f"Bearer {key}"},
                )
                for i in range(12)
            )
        )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert generations(one, two) == 3
        found = roles(one, two)
        assert found["leader"] == 3 and found["off"] == 0
        # Followers on the other replica read the leader's stream from Redis (a pipeline that
        # runs a script, which the cluster's node must have loaded).
        assert found["follower"] >= 1
        # A flight's lock, stream and readers share a slot of the flight's own: one tenant's
        # flights are spread over the nodes (a cache key holds its tenant's tag).
        flights = flights_of(one)
        for n in range(32):
            cache_key = f"{one.services.kv.tag('coalesce')}:{n:064x}"
            lock = flights.lock_key(cache_key)
            assert node_of(redis_cluster, lock) == node_of(
                redis_cluster, flights.readers_key(cache_key, "token")
            )
        spread = {
            node_of(redis_cluster, flights.lock_key(f"{{coalesce}}:{n:064x}")) for n in range(32)
        }
        assert len(spread) == 3


async def test_rate_limits_read_the_tenants_record_and_count_across_replicas(kv) -> None:
    prefix = f"rl{uuid.uuid4().hex[:6]}:"
    config = LimitConfig(key_rpm=0, key_tpm=0, tenant_rpm=100, tenant_tpm=0)
    one = RateLimiter(kv, config, prefix=prefix, record_ttl=0.0)
    two = RateLimiter(kv, config, prefix=prefix, record_ttl=0.0)
    await kv.hset(tenant_record(kv, prefix, "acme"), {"rpm": 3})
    who = Principal("acme", "alice", frozenset({"chat"}), "k1")
    decisions = [await (one, two)[i % 2].admit(who) for i in range(4)]
    assert [d.admitted for d in decisions] == [True, True, True, False]
    other = Principal("globex", "bob", frozenset({"chat"}), "k2")
    assert (await one.admit(other)).admitted, "another tenant's budget is its own"


async def test_features_are_written_and_read_in_one_lookup_and_the_log_is_found(
    kv, redis_cluster
) -> None:
    store = FeatureStore(kv, prefix=f"f{uuid.uuid4().hex[:6]}:")
    users = [f"user{n}" for n in range(12)]
    rows = [FeatureRow("acme", u, {"request_count": n + 1}) for n, u in enumerate(users)]
    assert await store.write_many(rows) == len(users)
    looked = [await store.load("acme", u, log={"route": "small"}) for u in users]
    assert [lookup.status for lookup in looked] == ["hit"] * len(users)
    assert [lookup.features.get("request_count") for lookup in looked] == list(range(1, 13))
    assert len({node_of(redis_cluster, store.key("acme", u)) for u in users}) > 1
    # A user's keys are on one node: its lookup is one round trip.
    hour = int(time.time() // 3600)
    for user in users:
        assert node_of(redis_cluster, store.key("acme", user)) == node_of(
            redis_cluster, store.rate_key("acme", user, hour)
        )
    logged = await store.read_log()  # found by a scan of every node
    assert {record["user"] for record in logged} == set(users)


async def test_a_job_is_submitted_run_and_finished(kv) -> None:
    queue = JobQueue(kv, prefix=f"j{uuid.uuid4().hex[:6]}:")
    await queue.ensure_group()
    job, created = await queue.submit(make_job("on a cluster"), "idem-1")
    assert created
    again, created_again = await queue.submit(make_job("on a cluster"), "idem-1")
    assert not created_again and again.id == job.id
    [delivery] = await queue.read("worker-1", count=1, block_ms=1000)
    kind, attempt, _ = await queue.start(delivery, "lease-1")
    assert (kind, attempt) == ("run", 1)
    await queue.finish(delivery, "lease-1", SUCCEEDED, {"answer": "done"})
    stored = await queue.get(job.id)
    assert stored is not None and stored.status == SUCCEEDED


def test_index_versions_and_backend_moves_use_the_cluster(redis_cluster) -> None:
    prefix = f"v{uuid.uuid4().hex[:6]}:"
    tenants = [f"tenant{n}" for n in range(12)]
    writer = RedisVersions(redis_cluster.url, prefix, reload_interval_s=0, cluster=True)
    reader = RedisVersions(redis_cluster.url, prefix, reload_interval_s=0.05, cluster=True)
    try:
        assert {reader.get(t) for t in tenants} == {reader.get("never")}
        bumped = {t: writer.bump(t) for t in tenants}
        # The reader's poll reads every tenant it follows at once, over all the nodes.
        for _ in range(100):
            if all(reader.get(t) == bumped[t] for t in tenants):
                break
            time.sleep(0.05)
        assert {t: reader.get(t) for t in tenants} == bumped
    finally:
        writer.close()
        reader.close()

    overrides = RedisOverrides(redis_cluster.url, prefix, reload_interval_s=0, cluster=True)
    try:
        overrides.set("acme", "milvus")
        assert overrides.get("acme") == "milvus"
        fence = overrides.fence()
        # Admitting a write reads the move, the writes and the backends hash in one script.
        token, backend = fence.enter("acme")
        assert backend == "milvus" and fence.writes_in_flight("acme") == 1
        assert fence.leave("acme", token)
        move = fence.begin("globex")
        assert fence.holds("globex", move)
        fence.end("globex", move)
    finally:
        overrides.close()


async def test_a_scan_visits_every_node(kv, redis_cluster) -> None:
    prefix = f"s{uuid.uuid4().hex[:6]}:"
    names = [f"{prefix}{n}" for n in range(40)]
    for name in names:
        await kv.set(name, b"x")
    assert len({node_of(redis_cluster, n) for n in names}) == 3
    # A client's first command may be the scan (``rag keys list --rescan``).
    fresh = KeyValueStore.from_url(redis_cluster.url, trace.NoOpTracer(), cluster=True)
    try:
        found = {k.decode() for k in await fresh.scan(f"{prefix}*")}
    finally:
        await fresh.aclose()
    assert found == set(names)


def flush_scripts(cluster: RedisClusterServers) -> None:
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            client.script_flush()


async def test_pipelines_that_start_together_wait_for_one_load_of_the_scripts(
    redis_cluster,
) -> None:
    flush_scripts(redis_cluster)
    fresh = KeyValueStore.from_url(redis_cluster.url, trace.NoOpTracer(), cluster=True)
    try:
        flights = SingleFlight(fresh, prefix=f"r{uuid.uuid4().hex[:6]}:")

        def counting_in(n: int) -> Any:
            async def queue(pipe: Any) -> None:
                name = flights.readers_key(f"k{n}", "token")
                await flights.reading_script(keys=[name], args=["me", 5000], client=pipe)

            return queue

        results = await asyncio.gather(
            *(fresh.pipeline("reading", counting_in(n)) for n in range(8)),
            return_exceptions=True,
        )
        assert [r for r in results if isinstance(r, BaseException)] == []
    finally:
        await fresh.aclose()


async def test_a_node_that_lost_its_scripts_costs_one_pipeline(kv, redis_cluster) -> None:
    flights = SingleFlight(kv, prefix=f"p{uuid.uuid4().hex[:6]}:")
    readers = flights.readers_key("k", "token")

    async def count_in(pipe: Any) -> None:
        await flights.reading_script(keys=[readers], args=["me", 5000], client=pipe)

    await kv.pipeline("reading", count_in)  # loaded on every primary before the first
    flush_scripts(redis_cluster)
    with pytest.raises(StoreUnavailable):
        await kv.pipeline("reading", count_in)
    await kv.pipeline("reading", count_in)  # loaded again


def test_a_brace_in_the_key_prefix_is_refused_on_a_cluster() -> None:
    with pytest.raises(ValidationError, match="must not contain"):
        Settings(redis={"cluster": True, "key_prefix": "rag:{x}:"})
    assert Settings(redis={"key_prefix": "rag:{x}:"}).redis.key_prefix == "rag:{x}:"


async def test_with_a_node_down_requests_are_answered_and_the_cache_returns_with_it(
    make_app, redis_cluster, vllm
) -> None:
    async with make_app(on_cluster(redis_cluster, vllm.url)) as h:
        key = await h.key("acme")
        bodies = [ask(unique_question()) for _ in range(6)]
        for body in bodies:  # the key is resolved and cached in the replica
            assert (await h.chat(key, body)).headers["x-cache"] == "miss"
        down = redis_cluster.nodes[1]
        down.stop()
        try:
            # Some of these answers live on the stopped node's slots: every request is still
            # answered (the cache and the lookups fail open), none waits past its bound.
            answered = [await h.chat(key, body) for body in bodies]
            assert [r.status_code for r in answered] == [200] * len(bodies)
        finally:
            redis_cluster.start_node(down)
        redis_cluster.wait_ready()
        # Back: a new answer is stored and found again (the node came back empty).
        body = ask(unique_question())
        assert (await h.chat(key, body)).headers["x-cache"] == "miss"
        for _ in range(40):
            again = await h.chat(key, body)
            if again.headers["x-cache"] == "hit":
                break
            await asyncio.sleep(0.25)
        assert again.headers["x-cache"] == "hit"


async def test_a_key_store_made_from_anothers_prefix_names_the_same_keys(kv) -> None:
    first = ApiKeyStore(kv, prefix=f"k{uuid.uuid4().hex[:6]}:apikey:")
    assert first.prefix.endswith(":{keys}:")
    again = ApiKeyStore(kv, prefix=first.prefix)  # as a second replica's store in a test
    assert (again.prefix, again.channel) == (first.prefix, first.channel)
    raw = await first.create("acme", "alice", frozenset({"chat"}))
    assert await again.revoke(raw) is not None
    assert await first.resolve(raw) is None


def running(cluster: RedisClusterServers) -> Iterator[RedisClusterServers]:
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def replicated_cluster() -> Iterator[RedisClusterServers]:
    """Three primaries, each with a replica that takes its place 1 s after it stops answering."""
    yield from running(RedisClusterServers(nodes=6, replicas=1, node_timeout_ms=1000))


async def test_a_failed_primary_is_replaced_by_its_replica_and_what_it_held_is_served_again(
    make_app, replicated_cluster, vllm
) -> None:
    cluster = replicated_cluster
    async with make_app(on_cluster(cluster, vllm.url)) as h:
        key = await h.key("acme")
        bodies = [ask(unique_question()) for _ in range(3)]
        for body in bodies:
            assert (await h.chat(key, body)).headers["x-cache"] == "miss"
        primary = next(n for n in cluster.nodes if n.port == node_of(cluster, "{acme}"))
        cluster.ask(primary, "wait", "1", "2000")  # the answers reached its replica
        primary.stop()
        # Answered while the cluster notices and promotes the replica (the cache fails open).
        during = [await h.chat(key, body) for body in bodies]
        assert [r.status_code for r in during] == [200] * len(bodies)
        # Failed (not only suspected, "fail?"), then the cluster whole again.
        wait_for(lambda: "fail" in cluster.flags(primary), 30, "the stopped primary failed")
        cluster.wait_ready()
        promoted = node_of(cluster, "{acme}")
        assert promoted != primary.port

        # The answers stored before the failover are served from the promoted replica.
        await hits_again(h, key, bodies)

        # A pipeline that runs a script on the promoted node: its script cache may be empty
        # (scripts are not replicated), which costs at most one pipeline.
        flights = flights_of(h)
        client = redis.RedisCluster.from_url(cluster.url)
        try:
            cache_key = next(
                k
                for k in (f"{{acme}}:{n:064x}" for n in range(1000))
                if client.get_node_from_key(flights.lock_key(k)).port == promoted
            )
        finally:
            client.close()

        async def count_in(pipe: Any) -> None:
            name = flights.readers_key(cache_key, "token")
            await flights.reading_script(keys=[name], args=["me", 5000], client=pipe)

        outcomes = []
        for _ in range(3):
            try:
                await h.services.kv.pipeline("reading", count_in)
                outcomes.append("ok")
            except StoreUnavailable:
                outcomes.append("failed")
        assert outcomes[1:] == ["ok", "ok"], outcomes


@pytest.fixture
def own_cluster() -> Iterator[RedisClusterServers]:
    """Three primaries of this test's own: it moves slots between them."""
    yield from running(RedisClusterServers(nodes=3))


async def test_a_tenants_slot_and_the_keys_slot_move_to_another_node_while_requests_run(
    make_app, own_cluster, vllm
) -> None:
    cluster = own_cluster
    # The limits' keys are in the moving slot too (a script whose keys are half moved is
    # refused: TRYAGAIN).
    async with make_app(on_cluster(cluster, vllm.url, limits=LIMITED)) as h:
        key, bodies = await cached_answers(h)
        client = redis.RedisCluster.from_url(cluster.url)
        try:
            slots = [client.keyslot("{acme}"), client.keyslot("{keys}")]
        finally:
            client.close()
        answered: list[tuple[int, str]] = []

        async def requests_until(done: asyncio.Future[Any]) -> None:
            n = 0
            while not done.done():
                reply = await h.chat(key, bodies[n % len(bodies)])
                answered.append((reply.status_code, reply.headers.get("x-cache", "")))
                n += 1
                if n % 8 == 0:  # now and then a miss: stored while the slot moves
                    fresh = await h.chat(key, ask(unique_question()))
                    answered.append((fresh.status_code, fresh.headers.get("x-cache", "")))

        moved = []
        for slot in slots:
            source = cluster.owner(slot)
            to = next(n for n in cluster.nodes if n.port != source.port)
            move = asyncio.ensure_future(
                asyncio.to_thread(cluster.move_slot, slot, to, pause_s=0.1)
            )
            await asyncio.gather(move, requests_until(move))
            moved.append(move.result())
            assert cluster.owner(slot).port == to.port
        assert all(n > 0 for n in moved), moved  # there was something to move in each

        # Every request answered while the slots moved (a command refused mid-move degrades
        # its stage; none fails the request).
        assert answered and {status for status, _ in answered} == {200}, answered
        hits = sum(cache == "hit" for _, cache in answered)
        print(f"{len(answered)} requests while {sum(moved)} keys moved: {hits} hits")
        # After: the answers cached before are served from the slot's new node, the key from
        # its slot's, and the limits' script runs there.
        await hits_again(h, key, bodies)
        fresh = await h.key("acme", "bob")  # the key store's create script, on the new node
        assert (await h.chat(fresh, bodies[0])).status_code == 200


async def test_a_primary_fails_over_while_sixteen_clients_keep_asking(
    make_app, replicated_cluster, vllm
) -> None:
    cluster = replicated_cluster
    async with make_app(on_cluster(cluster, vllm.url, limits=LIMITED)) as h:
        key, bodies = await cached_answers(h)
        primary = next(n for n in cluster.nodes if n.port == node_of(cluster, "{acme}"))
        cluster.ask(primary, "wait", "1", "2000")  # the answers reached its replica
        stop = asyncio.Event()
        answered: list[tuple[int, str, str]] = []

        async def keep_asking(n: int) -> None:
            i = 0
            while not stop.is_set():
                # Client 0 asks new questions (misses, stored as the slot changes hands);
                # the others repeat the cached ones (hits, and the limits' script each time).
                body = ask(unique_question()) if n == 0 else bodies[(n + i) % len(bodies)]
                reply = await h.chat(key, body)
                answered.append((reply.status_code, reply.headers.get("x-cache", ""), reply.text))
                i += 1

        clients = [asyncio.create_task(keep_asking(n)) for n in range(16)]
        try:
            await asyncio.sleep(0.5)
            before = len(answered)
            await asyncio.to_thread(primary.stop)
            await asyncio.to_thread(
                wait_for, lambda: "fail" in cluster.flags(primary), 30, "the primary failed"
            )
            await asyncio.to_thread(cluster.wait_ready)
            during = len(answered) - before
            await asyncio.sleep(1.0)  # and on, after the promotion
        finally:
            stop.set()
            await asyncio.gather(*clients)
        refused = [text for status, _, text in answered if status != 200]
        assert not refused, refused[:3]
        assert during > 0  # requests were answered while the cluster failed over
        hits = sum(cache == "hit" for _, cache, _ in answered)
        print(f"{len(answered)} requests, {during} during the failover, {hits} hits")
        promoted = node_of(cluster, "{acme}")
        assert promoted != primary.port
        await hits_again(h, key, bodies)  # the cached answers, from the promoted replica
