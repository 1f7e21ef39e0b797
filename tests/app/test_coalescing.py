"""Request coalescing through the service (``pipeline.store.singleflight``), against the real
vLLM and a real Redis: identical concurrent misses share one generation, on one replica or two;
streamed followers get the leader's chunks from the first; the leader's error reaches its
followers; a cancelled leader hands over; nothing is shared across tenants or access scopes,
nor for requests the cache would not store; Redis down turns it off and answers all the same.

Generations are counted as the services' model calls (their ``chat {model}`` spans): the vLLM
server is shared by other test runs, so its own counters would count theirs too.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import create_app
from pipeline.features.store import FeatureStore
from pipeline.stages.features import LoadFeatures
from pipeline.stages.generate import Generate
from pipeline.store.kv import KeyValueStore
from pipeline.store.singleflight import SingleFlight
from pipeline.telemetry import attributes as attr
from tests.app.test_access import PUBLIC, SECRET, ingest
from tests.app.test_access import key as key_with_groups
from tests.conftest import AppHarness, chat_request, make_settings, unique_question
from tests.pipeline.test_singleflight import settled
from tests.support.faultproxy import FaultProxy, hold_after_content
from tests.support.servers import UNENDING, LiveService

WORDS = [
    "apple", "river", "candle", "tiger", "violin", "copper", "garden", "rocket",
    "pepper", "island", "marble", "falcon", "lemon", "harbor", "silver", "meadow",
]  # fmt: skip


def settings(redis_url: str, llm_url: str, **groups: dict[str, Any]) -> Any:
    """A test app's settings, with routing and features off: under a burst on two shared cores
    the router and the feature lookup run past their time budgets and degrade, and an answer
    made after a degraded stage is shared only among requests degraded alike
    (``pipeline.stages.cache``'s ``unshareable``; a test of its own below); here one flight per
    prompt is under test. Redis gets a longer socket timeout for the
    same reason (an event loop busy with 256 requests reads its replies late)."""
    return make_settings(
        redis_url,
        llm_url,
        routing={"enabled": False},
        features={"enabled": False},
        redis={"timeout_seconds": 2.0},
        **groups,
    )


def ask(question: str, **extra: Any) -> dict[str, Any]:
    # No retrieval: the tests' tenants have no documents, and the prompt is the question alone.
    return chat_request(question, max_tokens=8, rag={"enabled": False}, **extra)


def spans(*harnesses: AppHarness | InMemorySpanExporter) -> list[ReadableSpan]:
    exporters = [h if isinstance(h, InMemorySpanExporter) else h.exporter for h in harnesses]
    return [span for exporter in exporters for span in exporter.get_finished_spans()]


def generations(*harnesses: AppHarness | InMemorySpanExporter) -> int:
    """The model calls the services made (one ``chat {model}`` span each)."""
    return sum(1 for span in spans(*harnesses) if span.name.startswith("chat "))


def roles(*harnesses: AppHarness | InMemorySpanExporter) -> Counter[str]:
    found = (span.attributes or {} for span in spans(*harnesses) if span.name == "stage generate")
    return Counter(str(a.get(attr.COALESCED)) for a in found)


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.fixture
async def replicas(make_app, redis_server, vllm):
    """Two replicas of the service (two apps, one Redis, the same key prefix)."""
    both = settings(redis_server.url, vllm.url)
    async with make_app(both) as one, make_app(both) as two:
        yield one, two


async def test_256_concurrent_requests_over_16_prompts_make_16_generations_on_two_replicas(
    replicas,
) -> None:
    one, two = replicas
    key = await one.key("coalesce")
    tag = unique_question()[-11:]  # a fresh cache for this run
    prompts = [f"Say the word {word}. {tag}" for word in WORDS]
    # Request i asks prompt i % 16 on replica (i // 16) % 2: every prompt on both replicas.
    answers = await asyncio.gather(
        *((one, two)[(i // 16) % 2].chat(key, ask(prompts[i % 16])) for i in range(256))
    )

    assert generations(one, two) == 16
    # A request whose lookup came after its prompt's answer was stored is a plain hit.
    hits = sum(response.headers["x-cache"] == "hit" for response in answers)
    found = roles(one, two)
    assert found["leader"] == 16 and found["off"] == 0
    assert found["leader"] + found["follower"] + hits == 256
    by_prompt: dict[str, set[str]] = {}
    for i, response in enumerate(answers):
        by_prompt.setdefault(prompts[i % 16], set()).add(content(response))
    for prompt, texts in by_prompt.items():
        # Each prompt's 16 requests got one answer: the one its own generation stored.
        stored = await two.chat(key, ask(prompt))
        assert stored.headers["x-cache"] == "hit"
        assert texts == {content(stored)}, prompt
    assert len({next(iter(texts)) for texts in by_prompt.values()}) > 1  # not one for all


def sse_content(lines: list[str]) -> list[str]:
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if e.get("choices") and e["choices"][0]["delta"].get("content")
    ]


@pytest.mark.parametrize("leader", ["reads on", "leaves"])
def test_streamed_followers_get_every_chunk_from_the_first(
    redis_server, vllm, shared_embedder, leader: str
) -> None:
    # "leaves": the leader's client closes its connection once the followers have joined. Its
    # answer was then stopped midway, and every follower, which had sent part of it, ended with
    # an error event (coalesced_leader_gone); now it is read on to its end for them.
    exporter = InMemorySpanExporter()
    with FaultProxy(vllm.url) as llm:
        app = create_app(
            settings(redis_server.url, llm.url),
            span_processors=[SimpleSpanProcessor(exporter)],
            embedder=shared_embedder,
        )
        body = ask(unique_question(), stream=True, logit_bias=UNENDING) | {"max_tokens": 48}
        # The model's answer is held after its 16th word until the followers have joined:
        # however slow the machine, or fast the model, they join an answer still being made.
        llm.rewrite(hold_after_content(llm, 16))

        async def joined(count: int, within: float) -> None:
            """Until ``count`` requests have passed the generate stage's join (its span ends
            there for a follower)."""
            loop = asyncio.get_running_loop()
            until = loop.time() + within
            while sum(roles(exporter).values()) < count:
                assert loop.time() < until, f"joined: {roles(exporter)} after {within} s"
                await asyncio.sleep(0.05)

        async def streams(url: str, headers: dict[str, str]) -> tuple[list[str], list[Any]]:
            async with (
                httpx.AsyncClient(base_url=url, timeout=120) as client,
                httpx.AsyncClient(base_url=url, timeout=120) as leaving,
            ):

                async def follow() -> tuple[str, list[str]]:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers=headers
                    ) as response:
                        lines = [x async for x in response.aiter_lines()]
                        return response.headers["x-cache"], lines

                got: list[str] = []
                async with leaving.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as led:
                    lines = led.aiter_lines()
                    while len(sse_content(got)) < 2:  # the leader has sent two chunks
                        got.append(await anext(lines))
                    assert llm.holding_requests(b"/v1/chat/completions", 1, timeout=60)
                    followers = [asyncio.create_task(follow()) for _ in range(3)]
                    try:
                        await joined(4, within=120)
                    finally:
                        if leader == "reads on":
                            llm.release()
                    if leader == "reads on":
                        got.extend([line async for line in lines])
                if leader == "leaves":
                    await leaving.aclose()  # its connection closed, the answer unread
                    await asyncio.sleep(0.5)  # the service has seen it go
                    llm.release()
                return got, [await task for task in followers]

        with LiveService(app) as live:
            key = live.run(app.state.services.keys.create("streams", "ann"))
            led, followed = asyncio.run(streams(live.url, {"Authorization": f"Bearer {key}"}))

    assert roles(exporter) == Counter({"leader": 1, "follower": 3})
    assert generations(exporter) == 1
    chunks = sse_content(followed[0][1])
    assert len(chunks) >= 8 and "".join(chunks).strip()
    if leader == "reads on":
        assert sse_content(led) == chunks
    else:
        assert sse_content(led) == chunks[: len(sse_content(led))], "its first chunks"
    for cache, lines in followed:
        assert cache == "miss"  # joined while the answer was being made, not from the cache
        assert not [line for line in lines if '"error"' in line], lines
        assert sse_content(lines) == chunks  # every chunk, from the first, in the same pieces
        assert [line for line in lines if line][-1] == "data: [DONE]"


def flights_of(harness: AppHarness) -> SingleFlight:
    """The replica's request coalescing (its generate stage's)."""
    found = [s.flights for s in harness.app.state.paths.chat.steps if isinstance(s, Generate)]
    assert found and found[0] is not None, "no coalescing in this app"
    return found[0]


def followers_waiting(*harnesses: AppHarness) -> int:
    """The requests that have joined a flight of these replicas and wait for its answer."""
    return sum(f.readers for h in harnesses for f in flights_of(h)._flights.values())


async def test_the_leaders_refusal_reaches_every_follower_as_the_same_error(
    make_app, redis_server, vllm
) -> None:
    with FaultProxy(vllm.url) as llm:
        both = settings(redis_server.url, llm.url)
        async with make_app(both) as one, make_app(both) as two:
            key = await one.key("refused")
            # vLLM refuses a logit_bias outside the vocabulary (a 400, its first event).
            body = ask(unique_question(), logit_bias={"99999999": 5})
            llm.pause()  # the refusal comes once every request has joined, however slow
            try:
                asking = [asyncio.create_task((one, two)[i % 2].chat(key, body)) for i in range(8)]
                await settled(lambda: followers_waiting(one, two) == 7, seconds=120)
            finally:
                llm.passing()
            answers = await asyncio.gather(*asking)

    assert {response.status_code for response in answers} == {400}
    assert len({response.text for response in answers}) == 1  # the same error, word for word
    assert answers[0].json()["error"]["code"] == "upstream_rejected"
    assert generations(one, two) == 1
    assert roles(one, two) == Counter({"leader": 1, "follower": 7})


async def test_a_cancelled_leader_hands_the_flight_to_a_follower(
    make_app, redis_server, vllm
) -> None:
    with FaultProxy(vllm.url) as llm:
        async with make_app(settings(redis_server.url, llm.url)) as h:
            key = await h.key("cancelled")
            body = ask(unique_question())
            llm.pause()  # the leader's model call hangs
            leader = asyncio.create_task(h.chat(key, body))
            await settled(lambda: llm.open_connections > 0)
            followers = [asyncio.create_task(h.chat(key, body)) for _ in range(4)]
            await settled(lambda: followers_waiting(h) == 4, seconds=120)  # wait for the leader
            assert not any(task.done() for task in followers)
            leader.cancel()  # its request dies mid-generation
            await asyncio.sleep(0.1)
            llm.passing()
            answers = await asyncio.gather(*followers)

    assert len({content(response) for response in answers}) == 1
    assert roles(h) == Counter({"leader": 2, "follower": 3})  # one follower took over


async def test_two_tenants_with_identical_bodies_never_share_a_generation(replicas) -> None:
    one, _ = replicas
    keys = [await one.key("tenant-a"), await one.key("tenant-b")]
    body = ask(unique_question())
    answers = await asyncio.gather(*(one.chat(keys[i % 2], body) for i in range(8)))

    assert all(response.status_code == 200 for response in answers)
    assert generations(one) == 2
    assert roles(one) == Counter({"leader": 2, "follower": 6})


async def test_callers_who_may_see_different_documents_never_share_a_generation(
    make_app, redis_server, vllm
) -> None:
    async with make_app(settings(redis_server.url, vllm.url)) as h:
        ann = await key_with_groups(h, "acme", "ann", ("finance",))
        bob = await key_with_groups(h, "acme", "bob")
        cid = await key_with_groups(h, "acme", "cid", ("finance",))
        await ingest(h, ann, [SECRET, *PUBLIC])
        body = chat_request(
            "What are the merger terms for Acme and Globex?" + unique_question()[-10:],
            max_tokens=6,
            rag={"top_k": 5, "min_relevance": 0},
        )
        keys = [ann, bob, cid]
        answers = await asyncio.gather(*(h.chat(keys[i % 3], body) for i in range(9)))

    assert all(response.status_code == 200 for response in answers)
    # ann and cid see the memo and share one generation; bob does not, and has his own.
    assert generations(h) == 2
    assert roles(h) == Counter({"leader": 2, "follower": 7})
    memo = {i % 3 for i, r in enumerate(answers) if SECRET["id"] in str(r.json()["rag"])}
    assert memo == {0, 2}


@pytest.mark.parametrize("header", ["no-cache", "no-store"])
async def test_requests_the_cache_would_not_serve_or_keep_do_not_coalesce(replicas, header) -> None:
    one, _ = replicas
    key = await one.key("fresh")
    body = ask(unique_question())
    answers = await asyncio.gather(
        *(one.chat(key, body, **{"Cache-Control": header}) for _ in range(4))
    )

    assert all(response.status_code == 200 for response in answers)
    assert generations(one) == 4
    assert roles(one) == Counter({"off": 4})


async def test_requests_made_after_a_degraded_stage_share_among_themselves_uncached(
    make_app, redis_server, vllm
) -> None:
    """The feature lookup degrades on every request (its Redis, behind a proxy, answers seconds
    after the 10 ms budget): the answers are made with the features' defaults, shared among the
    requests of one prompt, on both replicas, and not cached."""
    with FaultProxy(vllm.url) as llm, FaultProxy(redis_server.url) as slow_redis:
        degrading = with_features(redis_server.url, llm.url, budget_s=0.01)
        slow_redis.slow(5.0)
        async with make_app(degrading) as one, make_app(degrading) as two:
            for replica in (one, two):
                slow_features(replica, slow_redis.url)
            key = await one.key("defaults")
            tag = unique_question()[-11:]
            prompts = [f"Say the word {word}. {tag}" for word in WORDS[:4]]
            llm.pause()  # the answers come once every request has joined, however slow
            try:
                asking = [
                    asyncio.create_task((one, two)[(i // 4) % 2].chat(key, ask(prompts[i % 4])))
                    for i in range(32)
                ]
                await settled(lambda: followers_waiting(one, two) == 28, seconds=120)
            finally:
                llm.passing()
            answers = await asyncio.gather(*asking)
            again = await one.chat(key, ask(prompts[0]))
            found = spans(one, two)
            for replica in (one, two):
                await features_stage(replica).store.kv.aclose()

    texts: dict[str, set[str]] = {prompt: set() for prompt in prompts}
    for i, response in enumerate(answers):
        texts[prompts[i % 4]].add(content(response))
    assert all(len(answered) == 1 for answered in texts.values()), texts
    assert sum(1 for span in found if span.name.startswith("chat ")) == 5  # again: its own
    generated = [span.attributes or {} for span in found if span.name == "stage generate"]
    assert Counter(str(a.get(attr.COALESCED)) for a in generated) == Counter(
        {"leader": 5, "follower": 28}
    )
    assert {a.get(attr.COALESCE_DETAIL) for a in generated} == {"degraded: features"}
    assert again.headers["x-cache"] == "miss"  # made with defaults: never cached


async def test_requests_made_after_a_degraded_stage_follow_a_flight_led_on_another_replica(
    make_app, redis_server, vllm
) -> None:
    """Replica two's feature lookup degrades on every request, replica one's does not: the
    degraded requests on two follow the answer one is making without defaults (the answer
    the cache would serve them a moment later) rather than generate one of their own."""
    with FaultProxy(vllm.url) as llm, FaultProxy(redis_server.url) as slow_redis:
        healthy = with_features(redis_server.url, llm.url, budget_s=5.0)
        features = healthy.features.model_copy(update={"timeout_seconds": 0.01})
        degrading = healthy.model_copy(update={"features": features})  # one key prefix
        slow_redis.slow(5.0)
        async with make_app(healthy) as one, make_app(degrading) as two:
            lookup = slow_features(two, slow_redis.url)
            key = await one.key("followed")
            body = ask(unique_question())
            llm.pause()  # the leader's answer comes once every follower has joined
            try:
                leading = asyncio.create_task(one.chat(key, body))
                await settled(lambda: llm.open_connections > 0)
                following = [asyncio.create_task(two.chat(key, body)) for _ in range(4)]
                await settled(lambda: followers_waiting(two) == 4, seconds=120)
            finally:
                llm.passing()
            answers = await asyncio.gather(leading, *following)
            await lookup.store.kv.aclose()

    assert len({content(response) for response in answers}) == 1
    assert generations(one, two) == 1
    assert roles(one) == Counter({"leader": 1})
    followed = [span.attributes or {} for span in spans(two) if span.name == "stage generate"]
    assert Counter(str(a.get(attr.COALESCED)) for a in followed) == Counter({"follower": 4})
    assert {a.get(attr.COALESCE_DETAIL) for a in followed} == {
        "followed an answer made without defaults"
    }


def with_features(redis_url: str, llm_url: str, *, budget_s: float) -> Any:
    """Settings with the feature lookup on, at ``budget_s`` (routing off)."""
    return make_settings(
        redis_url,
        llm_url,
        routing={"enabled": False},
        features={"enabled": True, "timeout_seconds": budget_s},
        redis={"timeout_seconds": 2.0},
    )


def slow_features(harness: AppHarness, redis_url: str) -> LoadFeatures:
    """The replica's feature lookup, its store reached at ``redis_url`` (a slow proxy) from
    now on; the caller closes that store's connection."""
    lookup = features_stage(harness)
    lookup.store = FeatureStore(
        KeyValueStore.from_url(redis_url, harness.services.tracer, timeout=10.0),
        prefix=lookup.store.prefix,
    )
    return lookup


def features_stage(harness: AppHarness) -> LoadFeatures:
    stages = harness.app.state.paths.chat.stages
    found = next((stage for stage in stages if isinstance(stage, LoadFeatures)), None)
    assert found is not None, "no features stage on the path"
    return found


async def test_coalescing_can_be_switched_off(make_app, redis_server, vllm) -> None:
    async with make_app(settings(redis_server.url, vllm.url, cache={"coalesce": False})) as h:
        key = await h.key("bench")
        body = ask(unique_question())
        answers = await asyncio.gather(*(h.chat(key, body) for _ in range(4)))

    assert all(response.status_code == 200 for response in answers)
    assert generations(h) == 4
    assert roles(h) == Counter({"None": 4})  # the stage does not try


async def test_with_redis_down_every_request_is_still_answered(make_app, redis_server, vllm):
    with FaultProxy(redis_server.url) as redis:
        async with make_app(settings(redis.url, vllm.url)) as h:
            key = await h.key("outage")
            # Subscribed first: a subscription confirmed after the warm request would forget
            # the key it resolved (what changed while unsubscribed is unknown), and with Redis
            # down an unknown key cannot be checked.
            await settled(lambda: h.services.keys.subscribed)
            warm = await h.chat(key, ask(unique_question()))  # the key is now known here
            assert warm.status_code == 200
            h.exporter.clear()
            redis.refuse()  # new connections refused ...
            redis.cut()  # ... and the open ones closed: a stopped redis-server
            body = ask(unique_question())
            answers = await asyncio.gather(*(h.chat(key, body) for _ in range(4)))

    assert [response.status_code for response in answers] == [200] * 4, answers[0].text
    assert generations(h) == 4
    assert roles(h) == Counter({"off": 4})
    details = {
        (span.attributes or {}).get(attr.COALESCE_DETAIL)
        for span in spans(h)
        if span.name == "stage generate"
    }
    assert details == {"cache error"}
