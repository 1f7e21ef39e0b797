"""The happy path against the real vLLM server and a real Redis: SDK, cache, tenancy, spans."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from app.main import create_app
from pipeline.store.keys import hash_key
from tests.conftest import chat_request, make_settings, unique_question
from tests.pipeline.test_singleflight import settled
from tests.support.servers import UNENDING, LiveService, streamed_chat, wait_for

# The default path. The group's members run concurrently.
GROUP = ["features", "retrieve", "tools", "guard_similarity"]
PATH = ["auth", "validate", "guard_in", "cache_lookup", "adapt", *GROUP, "compress", "route"]
PATH += ["generate"]
PATH += ["guard_out", "cache_store"]


def body(question: str, **extra: Any) -> dict[str, Any]:
    return chat_request(question, **{"max_tokens": 12, **extra})


def sse_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        yield h


def test_openai_sdk_streams_and_gets_usage_through_the_service(redis_server, vllm) -> None:
    app = create_app(make_settings(redis_server.url, vllm.url))
    with LiveService(app) as live:
        key = live.run(app.state.services.keys.create("sdk-tenant", "bob"))
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)

        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": unique_question()}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        pieces = [
            c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
        ]
        assert len(pieces) >= 2, "the answer arrives in several chunks, not one"
        assert "".join(pieces).strip()
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert finish in (["stop"], ["length"])

        completion = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        # SmolLM2-135M's first tokens are near-ties ("The" / "L'"), so the words are not asserted.
        assert completion.choices[0].message.content.strip()
        assert completion.model == "smollm2"
        assert completion.usage.prompt_tokens > 0
        assert completion.usage.completion_tokens > 0
        assert completion.usage.total_tokens == (
            completion.usage.prompt_tokens + completion.usage.completion_tokens
        )


async def test_identical_request_is_a_cache_hit_without_calling_the_llm(harness) -> None:
    key = await harness.key()
    request = body(unique_question())
    first = await harness.chat(key, request)
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss"
    harness.exporter.clear()

    second = await harness.chat(key, request)
    assert second.status_code == 200
    assert second.headers["x-cache"] == "hit"
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert second.json()["usage"] == first.json()["usage"]
    names = [s.name for s in harness.exporter.get_finished_spans()]
    assert not any(n.startswith("chat ") or n == "stage generate" for n in names), names


# What another version of the service, or damage, can leave under a cache key (a review's
# reproducers, 2026-12-05: each was a 500 for every request of that question, for the entry's TTL).
UNREADABLE_ENTRIES = {
    "not UTF-8": b"\xff\xfe\x00",
    "not JSON": b"{not json",
    "a JSON list": b"[1, 2]",
    "fields missing": b'{"content": "x"}',
    "a citation of another shape": (
        b'{"content": "x", "finish_reason": "stop", "model": "m", "citations": [{"text_span": 5}]}'
    ),
    "sources that are not objects": (
        b'{"content": "x", "finish_reason": "stop", "model": "m", "sources": [1, 2]}'
    ),
    "tool calls as a string": (
        b'{"content": "x", "finish_reason": "stop", "model": "m", "tool_calls": "abc"}'
    ),
}


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("stored", list(UNREADABLE_ENTRIES))
async def test_a_cached_entry_that_cannot_be_read_is_a_miss_whose_answer_replaces_it(
    harness, stored: str, streamed: bool
) -> None:
    key = await harness.key()
    request = body(unique_question(), stream=streamed)
    assert (await harness.chat(key, request)).headers["x-cache"] == "miss"
    client = harness.services.kv.client
    prefix = harness.app.state.settings.redis.key_prefix
    entries: list[bytes] = []  # the answer's, and a plain one's alias (``app.http.fastpath``)

    async def stored_answer() -> bool:  # the answer is stored once the response has ended
        found = [name async for name in client.scan_iter(match=f"{prefix}cache*:acme:*")]
        entries[:] = [name for name in found if not name.endswith(b":copies")]  # the alias set
        values = [await client.get(name) for name in entries]
        return len(entries) == (1 if streamed else 2) and UNREADABLE_ENTRIES[stored] not in values

    await settled_async(stored_answer)
    for entry in entries:
        await client.set(entry, UNREADABLE_ENTRIES[stored])
    answer = await harness.chat(key, request)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-cache"] == "miss"
    await settled_async(stored_answer)  # the miss's answer in the entry's place
    again = await harness.chat(key, request)
    assert again.status_code == 200 and again.headers["x-cache"] == "hit"


# A record's tenant and user name index directories and Redis keys: one that breaks the rules
# keys are created by (only dots, a colon, a path) is another version's or a damaged record.
DAMAGED_RECORDS = {
    "a tenant that is not UTF-8": ("tenant", b"\xff\xfe"),
    "a tenant of only dots": ("tenant", b".."),
    "a tenant with a colon": ("tenant", b"acme:other"),
    "a user that is a path": ("user", b"../alice"),
}


@pytest.mark.parametrize("damage", [*DAMAGED_RECORDS, "no tenant"])
async def test_a_key_whose_record_cannot_be_read_is_refused_as_unknown_not_a_500(
    harness, damage: str
) -> None:
    raw = await harness.key()
    record = harness.services.keys.prefix + hash_key(raw)
    client = harness.services.kv.client
    if damage == "no tenant":
        await client.hdel(record, "tenant")
    else:
        await client.hset(record, *DAMAGED_RECORDS[damage])
    for streamed in (False, True):
        answer = await harness.chat(raw, body(unique_question(), stream=streamed))
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["type"] == "authentication_error"
    models = await harness.client.get("/v1/models", headers={"Authorization": f"Bearer {raw}"})
    assert models.status_code == 401, models.text


@pytest.mark.parametrize("damage", list(DAMAGED_RECORDS))
async def test_a_key_whose_record_cannot_be_read_can_still_be_revoked_whole(
    harness, damage: str
) -> None:
    # The command an operator runs on such a key: it deleted the record, then failed reading
    # it, leaving the key's id index and the replicas' caches as they were.
    raw = await harness.key()
    keys = harness.services.keys
    record = keys.prefix + hash_key(raw)
    client = harness.services.kv.client
    key_id = (await client.hget(record, "key_id")).decode()
    await client.hset(record, *DAMAGED_RECORDS[damage])
    revoked = await keys.revoke(raw)
    assert revoked is not None and revoked.key_id == key_id
    assert not await client.exists(record)
    assert not await client.exists(keys._id_key(key_id)), "the key's id index was left"
    assert await keys.revoke(raw) is None


async def settled_async(check: Callable[[], Awaitable[bool]], seconds: float = 15.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never settled")


async def test_a_cached_answer_is_never_served_before_auth(harness) -> None:
    key = await harness.key()
    request = body(unique_question())
    assert (await harness.chat(key, request)).status_code == 200
    assert (await harness.chat(key, request)).headers["x-cache"] == "hit"
    assert (await harness.chat(None, request)).status_code == 401
    assert (await harness.chat("rag-forged.key", request)).status_code == 401


async def test_cache_hit_is_replayed_as_sse_when_a_stream_is_asked(harness) -> None:
    key = await harness.key()
    question = unique_question()
    plain = await harness.chat(key, body(question))
    assert plain.headers["x-cache"] == "miss"
    streamed = await harness.chat(
        key, body(question, stream=True, stream_options={"include_usage": True})
    )
    assert streamed.headers["x-cache"] == "hit"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    text = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e["choices"]
    )
    assert text == plain.json()["choices"][0]["message"]["content"]
    assert events[-2]["usage"] == plain.json()["usage"]


async def test_a_streamed_answer_is_cached_when_its_stream_ends(harness) -> None:
    key = await harness.key()
    question = unique_question()
    streamed = await harness.chat(key, body(question, stream=True))
    assert streamed.headers["x-cache"] == "miss"
    assert sse_events(streamed.text)[-1] == "[DONE]"
    again = await harness.chat(key, body(question))
    assert again.headers["x-cache"] == "hit"


async def test_cache_hit_for_other_tenant_is_a_miss(harness) -> None:
    request = body(unique_question())
    first = await harness.chat(await harness.key(tenant="tenant-a"), request)
    assert first.headers["x-cache"] == "miss"
    other = await harness.chat(await harness.key(tenant="tenant-b"), request)
    assert other.status_code == 200
    assert other.headers["x-cache"] == "miss"
    # Answers are personalised (features are on by default), so the user is in the key too;
    # with features off, users of a tenant share answers (tests/app/test_personalisation.py).
    same_tenant_other_user = await harness.chat(
        await harness.key(tenant="tenant-a", user="zed"), request
    )
    assert same_tenant_other_user.headers["x-cache"] == "miss"
    assert (await harness.chat(await harness.key(tenant="tenant-a"), request)).headers[
        "x-cache"
    ] == "hit"


async def test_cache_control_no_cache_skips_lookup_and_no_store_skips_write(harness) -> None:
    key = await harness.key()
    request = body(unique_question())
    first = await harness.chat(key, request, **{"Cache-Control": "no-store"})
    assert first.headers["x-cache"] == "miss"
    second = await harness.chat(key, request)
    assert second.headers["x-cache"] == "miss", "no-store must not have written the entry"
    third = await harness.chat(key, request, **{"Cache-Control": "no-cache"})
    assert third.headers["x-cache"] == "miss", "no-cache must skip the lookup"
    fourth = await harness.chat(key, request)
    assert fourth.headers["x-cache"] == "hit"


async def test_requests_are_answered_while_redis_is_down_and_caching_resumes(
    make_app, vllm
) -> None:
    from tests.support.servers import RedisServer

    redis = RedisServer()
    redis.start()
    settings = make_settings(redis.url, vllm.url, redis={"retry_after_seconds": 0.2})
    try:
        async with make_app(settings) as harness:
            key = await harness.key()
            warm = await harness.chat(key, body(unique_question()))
            assert warm.status_code == 200

            redis.stop()
            request = body(unique_question())
            down = await harness.chat(key, request)
            assert down.status_code == 200, down.text
            assert down.headers["x-cache"] == "miss"
            assert down.json()["rag"]["cache"] == "error"
            ready = await harness.client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["checks"] == {"redis": "down", "llm": "ok"}

            redis.start()
            # /readyz answers from a check at most a second old: ask until it has looked again.
            for _ in range(30):
                ready = await harness.client.get("/readyz")
                if ready.status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert ready.status_code == 200 and ready.json()["checks"]["redis"] == "ok"
            # This Redis keeps nothing across a restart, keys included; the service, once it
            # hears from Redis again (its key-change channel subscribed anew, which forgets
            # the keys it cached), no longer takes a key Redis does not have.
            await settled(lambda: harness.services.keys.subscribed)
            assert (await harness.chat(key, request)).status_code == 401
            key = await harness.key()
            stored = await harness.chat(key, request)
            assert stored.headers["x-cache"] == "miss"
            hit = await harness.chat(key, request)
            assert hit.headers["x-cache"] == "hit"
    finally:
        redis.stop()


async def test_one_trace_per_request_with_a_span_per_stage_in_order(harness) -> None:
    key = await harness.key()
    harness.exporter.clear()
    response = await harness.chat(key, body(unique_question()))
    assert response.status_code == 200
    finished = harness.exporter.get_finished_spans()
    trace_id = int(response.headers["x-trace-id"], 16)
    # The job workers' own commands (their consumer group, say) are traces of their own, which
    # may end while the request runs; every span of the request is in the request's one trace.
    spans = [s for s in finished if s.context.trace_id == trace_id]
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["POST /v1/chat/completions"]
    root = roots[0]
    outside = [s.name for s in finished if s.context.trace_id != trace_id]
    assert all(name.startswith("redis ") for name in outside), outside
    stages = sorted((s for s in spans if s.name.startswith("stage ")), key=lambda s: s.start_time)
    assert [s.name for s in stages] == [f"stage {name}" for name in PATH]
    group = next(s for s in spans if s.name == "group " + "+".join(GROUP))
    assert group.parent.span_id == root.context.span_id
    for stage in stages:
        in_group = stage.name.removeprefix("stage ") in GROUP
        parent = group if in_group else root
        assert stage.parent.span_id == parent.context.span_id, stage.name
    chat = next(s for s in spans if s.name == "chat smollm2")
    generate = next(s for s in stages if s.name == "stage generate")
    assert chat.parent.span_id == generate.context.span_id
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == "smollm2"
    assert chat.attributes["gen_ai.usage.input_tokens"] > 0
    assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    assert chat.attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert root.resource.attributes["service.name"] == "rag-pipeline"


async def test_prompt_text_stays_out_of_spans_unless_content_capture_is_on(
    harness, make_app, redis_server, vllm
) -> None:
    key = await harness.key()
    question = unique_question()
    harness.exporter.clear()
    assert (await harness.chat(key, body(question))).status_code == 200
    values = [str(v) for s in harness.exporter.get_finished_spans() for v in s.attributes.values()]
    assert not any(question in v for v in values)

    settings = make_settings(redis_server.url, vllm.url, telemetry={"capture_content": True})
    async with make_app(settings) as capturing:
        key = await capturing.key()
        answer = (await capturing.chat(key, body(question))).json()
        chat = next(s for s in capturing.exporter.get_finished_spans() if s.name.startswith("chat"))
        assert question in chat.attributes["gen_ai.input.messages"]
        content = answer["choices"][0]["message"]["content"]
        assert json.loads(chat.attributes["gen_ai.output.messages"])[0]["content"] == content


async def test_explain_reports_each_stage_and_its_duration(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, body(unique_question(), rag={"explain": True}))
    explain = response.json()["rag"]["explain"]
    assert sorted(s["name"] for s in explain["stages"]) == sorted(PATH)
    assert all(s["duration_ms"] >= 0 for s in explain["stages"])
    stages = {s["name"]: s for s in explain["stages"]}
    assert stages["retrieve"]["info"]["retrieval.skipped"] == "no index"
    assert stages["generate"]["info"]["ttft_ms"] > 0
    # The output redaction let the first text out after one piece or more of the model's.
    guard_out = stages["guard_out"]["info"]
    assert guard_out["guard.output.first_held_pieces"] >= 1
    assert guard_out["guard.output.first_held_ms"] >= 0
    assert stages["cache_lookup"]["info"]["cache.status"] == "miss"
    assert stages["route"]["info"]["route"] in ("small", "large")
    assert stages["features"]["status"] in ("ok", "degraded")
    # The group's members started together, after the cache lookup and before the route.
    group = [stages[n]["start_ms"] for n in GROUP]
    assert min(group) >= stages["cache_lookup"]["start_ms"]
    assert max(group) <= stages["route"]["start_ms"]


async def test_a_streamed_request_reaches_the_client_chunk_by_chunk(harness, vllm) -> None:
    key = await harness.key()
    async with harness.client.stream(
        "POST",
        "/v1/chat/completions",
        json=body("Count from one to ten in words.", max_tokens=24, stream=True),
        headers={"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"},
    ) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    contents = [
        json.loads(e[6:])["choices"][0]["delta"].get("content")
        for e in events[:-1]
        if json.loads(e[6:])["choices"]
    ]
    assert len([c for c in contents if c]) >= 3
    assert events[-1] == "data: [DONE]"


async def test_vllm_refusing_a_prompt_too_long_is_a_400(harness) -> None:
    key = await harness.key()
    long_prompt = "word " * 2600
    response = await harness.chat(key, body(long_prompt, max_tokens=8))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_client_leaving_mid_stream_stops_the_upstream_and_caches_nothing(
    redis_server, vllm
) -> None:
    app = create_app(make_settings(redis_server.url, vllm.url))
    question = "Write a long story about a dragon. " + unique_question()
    # All 600 tokens (the model may not end sooner): over 5 s on the fastest CPU engine yet.
    request = body(question, max_tokens=600, stream=True, logit_bias=UNENDING)
    # Nothing an earlier test left running is counted as this request.
    assert vllm.wait_idle() <= 0, "vLLM is still busy with an earlier test's requests"
    with LiveService(app) as live:
        key = live.run(app.state.services.keys.create("leaver", "lee"))
        with streamed_chat(live.url, key, request, 60) as response:
            assert response.status_code == 200
            for number, _ in enumerate(response.iter_lines()):
                if number > 6:
                    break  # hang up after a few chunks

        def running() -> float:
            metrics = httpx.get(f"{vllm.url}/metrics", timeout=5).text
            line = next(
                m for m in metrics.splitlines() if m.startswith("vllm:num_requests_running")
            )
            return float(line.rsplit(" ", 1)[1])

        # 600 tokens take vLLM on the CPU over 5 s: only an abort ends the request sooner.
        wait_for(lambda: running() == 0.0, 5, "vLLM dropping the abandoned request")
        # Asked again, streamed: its headers (sent with the first token) say whether it came
        # from the cache, without waiting for 600 tokens more. It is left in its turn, as above.
        with streamed_chat(live.url, key, request, 60) as again:
            assert again.status_code == 200
            assert again.headers["x-cache"] == "miss", "a half-sent stream must not be cached"
        wait_for(lambda: running() == 0.0, 5, "vLLM dropping the second abandoned request")
