"""Redis stopped, slowed, cut mid-request, or its connection pool full, behind a fault proxy:
requests are answered where they can be (the cache, the features and the rate limits degrade),
never with a 5xx, and the service recovers without a restart. The app runs under uvicorn
against the tests' own redis-server and the real vLLM."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from pipeline.errors import StoreBusy, StoreUnavailable
from pipeline.store.kv import KeyValueStore
from tests.conftest import chat_request, unique_question
from tests.faults.service import ProxiedService, proxied_service, redis_errors, sse_events
from tests.support.backlog import backlog
from tests.support.faultproxy import FaultProxy
from tests.support.servers import wait_for

# A short breaker; Redis timeouts of 3 s, not the 0.5 s default, and a features budget as long:
# the faults here fail at once (refused, cut) or are slow by at most 0.1 s a command, and each
# command that should succeed gets 30x that. At 0.5 s a loaded CI machine (the app, the proxies
# and the client share one process and its GIL) once ran a write of the slowed test past its
# timeout: the breaker opened and the next lookup failed open. Limits on, so the limiter talks
# to Redis on every request; no job workers (their blocking polls are not what these tests
# are about), and neither the similarity guard nor the router (what they embed at start-up
# costs seconds here, and they do not use Redis).
SETTINGS: dict[str, dict[str, Any]] = {
    "redis": {"timeout_seconds": 3.0, "retry_after_seconds": 0.3},
    "limits": {"key_rpm": 100_000, "tenant_rpm": 100_000},
    "features": {"timeout_seconds": 3.0},
    "jobs": {"workers": 0},
    "guard": {"similarity": False},
    "routing": {"enabled": False},
}


@pytest.fixture
def service(shared_embedder, redis_server, vllm) -> Iterator[ProxiedService]:
    with proxied_service(shared_embedder, redis_server.url, vllm.url, **SETTINGS) as served:
        yield served


def explained(question: str, **extra: Any) -> dict[str, Any]:
    return chat_request(question, rag={"explain": True}, **extra)


def stage(response: httpx.Response, name: str) -> dict[str, Any]:
    stages = response.json()["rag"]["explain"]["stages"]
    found: dict[str, Any] = next(s for s in stages if s["name"] == name)
    return found


def warm(service: ProxiedService) -> tuple[str, dict[str, Any]]:
    """A key, and a request whose answer is cached; both made through the proxy."""
    key = service.key()
    request = chat_request(unique_question())
    assert service.chat(key, request).headers["x-cache"] == "miss"
    assert service.chat(key, request).headers["x-cache"] == "hit"
    return key, request


def test_redis_stopped_requests_are_answered_and_it_recovers_without_a_restart(service) -> None:
    key, cached = warm(service)
    before = service.counts()

    service.redis.refuse()  # new connections refused ...
    service.redis.cut()  # ... and the open ones closed: a stopped redis-server
    answers = [service.chat(key, explained(unique_question())) for _ in range(3)]
    answers.append(service.chat(key, cached))
    streamed = service.chat(key, explained(unique_question(), stream=True))
    for answer in [*answers, streamed]:
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-cache"] == "miss"
    for answer in answers[:3]:
        assert answer.json()["rag"]["cache"] == "error"
        features = stage(answer, "features")
        assert features["status"] == "degraded", features
        assert features["info"]["error_type"] == "StoreUnavailable"
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and events[-2]["rag"]["cache"] == "error"
    assert service.client.get("/readyz").status_code == 503

    service.redis.passing()
    # Back within the breaker's 0.3 s: the cached answer is found again, no restart. Until the
    # breaker tries again, a key whose cached record has aged out (1 s without the key
    # channel) cannot be checked: 503 with Retry-After, which the loop waits through.
    started = time.monotonic()
    wait_for(lambda: service.chat(key, cached).headers.get("x-cache") == "hit", 10, "the cache")
    recovered_s = time.monotonic() - started
    assert recovered_s < 5.0, recovered_s
    fresh = explained(unique_question())
    assert service.chat(key, fresh).json()["rag"]["cache"] == "miss"
    assert stage(service.chat(key, fresh), "cache_lookup")["info"]["cache.status"] == "hit"
    # Readiness is checked at most once a second (the 503 above may still be the answer).
    wait_for(lambda: service.client.get("/readyz").status_code == 200, 5, "readiness")
    service.assert_settled(before)


def test_redis_slowed_to_100_ms_a_command_still_serves_the_cache_and_features(service) -> None:
    key, cached = warm(service)
    before = service.counts()

    service.redis.slow(0.1)
    question = explained(unique_question())
    slow = service.chat(key, question)
    assert slow.status_code == 200, slow.text
    assert slow.json()["rag"]["cache"] == "miss"
    assert stage(slow, "features")["status"] == "ok"
    assert stage(slow, "cache_lookup")["duration_ms"] >= 100  # the delay was really there
    again = service.chat(key, question)
    assert again.json()["rag"]["cache"] == "hit", (
        "the slowed store still wrote the answer",
        again.json()["rag"].get("explain"),
    )
    assert service.chat(key, cached).headers["x-cache"] == "hit"
    assert service.breaker_closed(), "a slow Redis is not a down one"

    service.redis.passing()
    service.assert_settled(before)


def test_redis_cut_mid_request_the_request_is_answered_and_the_next_ones_too(service) -> None:
    key, cached = warm(service)
    before = service.counts()

    service.redis.pause()
    with ThreadPoolExecutor(1) as sender:
        pending = sender.submit(service.chat, key, chat_request(unique_question()))
        assert service.redis.holding(), "the request never reached Redis"
        assert service.redis.cut() >= 1  # the commands in flight lose their connections
        service.redis.passing()
        answer = pending.result(60)
    assert answer.status_code == 200, answer.text
    assert service.chat(key, cached).headers["x-cache"] == "hit"
    service.assert_settled(before)


async def test_a_full_pool_waits_then_sheds_one_command_and_keeps_the_circuit_closed(
    redis_server,
) -> None:
    # Two connections, each command held 300 ms by the proxy: eight at once cannot all get one.
    with FaultProxy(redis_server.url) as proxy:
        proxy.slow(0.3)

        async def burst(pool_wait: float) -> list[Any]:
            kv = KeyValueStore.from_url(
                proxy.url, trace.NoOpTracer(), timeout=2.0, max_connections=2, pool_wait=pool_wait
            )
            try:
                results = await asyncio.gather(
                    *(kv.get(f"fault-pool-{n}") for n in range(8)), return_exceptions=True
                )
                assert proxy.open_connections <= 2, "the pool's bound holds"
                assert kv.available, "a full pool must not open the circuit for everyone"
                assert await kv.get("fault-pool-after") is None, "the next command is served"
                return results
            finally:
                await kv.aclose()

        shed = await burst(pool_wait=0.1)
        served = [r for r in shed if r is None]
        refused = [r for r in shed if isinstance(r, StoreUnavailable)]
        assert len(served) >= 2 and len(refused) >= 1, shed
        assert all(isinstance(r, StoreBusy) and r.code == "overloaded" for r in refused), refused
        # With a wait longer than the queue ahead of it, every command is served.
        assert await burst(pool_wait=5.0) == [None] * 8

        # A Redis that is really gone still opens it.
        proxy.refuse()
        kv = KeyValueStore.from_url(proxy.url, trace.NoOpTracer(), timeout=0.5)
        try:
            with pytest.raises(StoreUnavailable):
                await kv.get("fault-pool-down")
            assert not kv.available
        finally:
            await kv.aclose()
            proxy.passing()


async def test_a_full_pool_in_the_app_sheds_or_serves_hits_and_keeps_the_circuit_closed(
    shared_embedder, redis_server, vllm
) -> None:
    # Three connections, each command held 200 ms, eight requests at once.
    # Shedding comes from the 50 ms pool wait; a command that has a connection has 25x its
    # delay (at 5x, 1 s, a loaded machine could open the breaker).
    pool = {"max_connections": 3, "pool_wait_seconds": 0.05, "timeout_seconds": 5.0}
    settings = {**SETTINGS, "redis": {**SETTINGS["redis"], **pool}}
    with proxied_service(shared_embedder, redis_server.url, vllm.url, **settings) as service:
        key, cached = warm(service)
        before = service.counts()
        shed, skipped = redis_errors("MaxConnectionsError"), redis_errors("circuit_open")
        service.redis.slow(0.2)
        async with httpx.AsyncClient(base_url=service.live.url, timeout=60) as client:
            headers = {"Authorization": f"Bearer {key}"}
            answers = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=cached, headers=headers)
                    for _ in range(8)
                )
            )
        # A cache lookup that finds no connection sheds its request (503 overloaded, retry);
        # it never falls through into a generation a hit would have spared.
        assert {a.status_code for a in answers} <= {200, 503}, [a.text for a in answers]
        for answer in answers:
            if answer.status_code == 503:
                assert answer.json()["error"]["code"] == "overloaded", answer.text
                assert int(answer.headers["retry-after"]) >= 1
            else:
                assert answer.headers["x-cache"] == "hit", answer.json()["rag"]
        assert any(a.status_code == 200 for a in answers)
        assert redis_errors("circuit_open") == skipped, "shedding must not open the circuit"
        assert redis_errors("MaxConnectionsError") > shed, "some commands found no connection"
        assert service.breaker_closed()
        assert service.redis.open_connections <= 3, "the pool's bound holds"
        service.redis.passing()
        # The answers' own writes (the request log, the limiter's settling) drain the pool.
        service.assert_settled(before)
        # A hit again, once the last shed request's connections are back in the 3-slot pool.
        again = service.chat(key, cached)
        for _ in range(50):
            if again.status_code != 503:
                break
            await asyncio.sleep(0.2)
            again = service.chat(key, cached)
        assert again.status_code == 200, again.text
        assert again.headers["x-cache"] == "hit"


async def test_a_command_past_its_timeout_fails_alone_and_its_late_reply_reaches_no_other(
    redis_server,
) -> None:
    # The timeout bounds the whole command (one timer, not redis-py's per socket operation):
    # a reply held past it fails that command, the connection it was using is dropped, and the
    # next command on the pool gets its own reply, never the late one.
    with FaultProxy(redis_server.url) as proxy:
        kv = KeyValueStore.from_url(
            proxy.url, trace.NoOpTracer(), timeout=0.3, retry_after=0.0, max_connections=1
        )
        try:
            # Written without the store's timer: the setup is not what is timed.
            await kv.client.set("fault-late-a", b"a")
            await kv.client.set("fault-late-b", b"b")
            # The reply comes 6 s after the command: anything under 2 s was the 0.3 s timer
            # (however late a loaded machine runs it), never the reply.
            proxy.slow(3.0, responses=True)
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await kv.get("fault-late-a")
            assert time.monotonic() - started < 2.0, "the timeout bounds the command"
            proxy.passing()
            kv.timeout = 5.0  # the commands after it are not timed either
            assert await kv.get("fault-late-b") == b"b"
            assert await kv.get("fault-late-a") == b"a"
        finally:
            await kv.aclose()


async def test_a_subscription_holds_one_of_the_pools_connections(redis_server) -> None:
    # Two connections: while a subscription holds one, commands share the other, each waiting
    # for it in turn (the bound on connections holds), or, with a short pool wait, one of two
    # slow commands is shed; once it is closed, two slow commands run at once.
    with FaultProxy(redis_server.url) as proxy:
        for delay, wait in ((0.05, 5.0), (0.3, 0.1)):
            proxy.slow(delay)
            kv = KeyValueStore.from_url(
                proxy.url, trace.NoOpTracer(), timeout=2.0, max_connections=2, pool_wait=wait
            )
            try:
                async with kv.subscription() as pubsub:
                    await pubsub.subscribe("fault-channel")
                    got = await asyncio.gather(
                        *(kv.get(f"fault-sub-{n}") for n in range(6 if wait > 1 else 2)),
                        return_exceptions=True,
                    )
                    assert proxy.open_connections <= 2, "the pool's bound holds"
                    if wait > 1:
                        assert got == [None] * 6
                    else:
                        assert any(isinstance(r, StoreBusy) for r in got), got
                pair = await asyncio.gather(*(kv.get(f"fault-sub-{n}") for n in range(2)))
                assert pair == [None, None], "closed, it gave its connection back"
            finally:
                await kv.aclose()


async def test_a_paused_redis_fails_the_health_ping_and_the_key_listener_in_bounded_time(
    redis_server,
) -> None:
    # Neither has a socket timeout to fall back on (each command is bounded by the store's
    # own timer): a health ping says False, and the key change listener notices its channel
    # is lost, though the connection's reconnect hangs, then subscribes again once Redis is back.
    from pipeline.store.keys import ApiKeyStore

    with FaultProxy(redis_server.url) as proxy:
        kv = KeyValueStore.from_url(proxy.url, trace.NoOpTracer(), timeout=0.5)
        keys = ApiKeyStore(kv)
        listener = asyncio.create_task(keys.listen(retry_seconds=0.2, ping_seconds=0.5))
        try:
            await _until_true(lambda: keys.subscribed)
            proxy.pause()
            started = time.monotonic()
            assert await kv.ping() is False
            assert time.monotonic() - started < 2.0, "the ping is bounded"
            proxy.cut()  # the listener's connection drops; its reconnect meets the pause
            await _until_true(lambda: not keys.subscribed)
            proxy.passing()
            await _until_true(lambda: keys.subscribed)
            assert await kv.ping() is True
        finally:
            await keys.stop_listening(listener)
            await kv.aclose()


async def _until_true(condition: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.05)


async def test_a_stalled_event_loop_does_not_time_out_a_reply_that_arrived_during_the_stall(
    redis_server,
) -> None:
    # The reply comes 0.2 s after the command (0.1 s each way); the loop is blocked for 2 s
    # across the 0.2 s deadline (a garbage collection, say). The reply was there in time: the
    # command succeeds. Without a stall, a reply later than the deadline still fails the
    # command: it comes 6 s after it, so anything under 2 s was the timer.
    with FaultProxy(redis_server.url) as proxy:
        kv = KeyValueStore.from_url(proxy.url, trace.NoOpTracer(), timeout=0.2, retry_after=0.0)
        try:
            await kv.client.set("fault-stall", b"v")  # the setup, without the store's timer
            proxy.slow(0.1, responses=True)
            command = asyncio.create_task(kv.get("fault-stall"))
            await asyncio.sleep(0.02)  # sent; its reply is on its way
            time.sleep(2.0)  # noqa: ASYNC251 (the stall under test: the loop cannot run)
            assert await command == b"v"
            assert kv.available, "a stall is not Redis being down"
            proxy.slow(3.0, responses=True)
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await kv.get("fault-stall")
            assert time.monotonic() - started < 2.0
        finally:
            await kv.aclose()


async def test_a_backlogged_event_loop_neither_fails_commands_nor_opens_the_circuit(
    redis_server,
) -> None:
    # A burst of requests in one process: every turn of the loop takes 40 ms, for 2 s, and
    # each command opens a connection, as a burst's commands do while the pool grows (the
    # connect and the client's handshake, then the command: about five round trips). Redis
    # answers each 5 ms after it is asked (the proxy), about 25 ms a command, a quarter of its
    # 0.1 s bound; but each round trip waits a turn or two of the loop. Before the bound
    # counted the loop's lag, every command here failed and opened the circuit.
    with FaultProxy(redis_server.url) as proxy:
        kv = KeyValueStore.from_url(proxy.url, trace.NoOpTracer(), timeout=0.1)
        try:
            await kv.client.set("fault-backlog", b"v")  # the setup, without the store's timer
            proxy.slow(0.005)
            neighbour = asyncio.create_task(backlog(0.04, 2.0))
            replies = []
            while not neighbour.done():
                await kv.client.connection_pool.disconnect()
                replies.append(await kv.get("fault-backlog"))
                assert kv.available, "a backlogged loop is not Redis being down"
            assert len(replies) > 2 and set(replies) == {b"v"}
            assert await neighbour > 10
        finally:
            await kv.aclose()


async def test_redis_out_of_memory_is_said_in_the_log_once_a_minute_and_opens_no_circuit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A probe with Redis at its maxmemory (noeviction): every write was refused and counted in
    # rag_redis_errors_total, and the log said nothing (answers silently not cached, jobs
    # waiting, keys not made).
    import logging

    from tests.support.servers import RedisServer, over_its_memory

    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, trace.NoOpTracer(), timeout=10.0)
    try:
        await over_its_memory(kv.client)  # writes refused, reads go on
        caplog.set_level(logging.WARNING, logger="pipeline.store.kv")
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                await kv.set("refused", b"y" * 1000)
        said = [r for r in caplog.records if "out of memory" in r.getMessage()]
        assert len(said) == 1, said
        assert "SET" in said[0].getMessage() and kv.available, "Redis is up: no circuit"
        assert await kv.get("junk:0") is not None, "reads go on"
    finally:
        await kv.aclose()
        server.stop()
