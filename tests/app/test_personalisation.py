"""Per-user features on the chat path, against the real vLLM and a real Redis: the prompt's
personalisation line, the department filter, the cache key, and defaults when Redis fails."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from pipeline.features.spec import FEATURE_SET_VERSION, SPECS
from pipeline.features.store import FeatureRow
from pipeline.telemetry import attributes as attr
from tests.conftest import AppHarness, chat_request, make_settings, unique_question
from tests.support.servers import RedisServer

BATCH = sorted(name for name, spec in SPECS.items() if spec.source == "batch")

DOCS = [
    {
        "id": f"{department}-{n}",
        "title": f"{department.title()} handbook {n}",
        "text": f"Expense policy for the {department} team: {text}",
        "metadata": {"department": department},
    }
    for department, texts in {
        "sales": ["travel expenses are refunded within a week.", "client dinners need approval."],
        "engineering": ["hardware expenses need a ticket.", "conference expenses are capped."],
    }.items()
    for n, text in enumerate(texts)
]


def body(question: str, **extra: Any) -> dict[str, Any]:
    return chat_request(question, **{"max_tokens": 8, **extra})


async def load(harness: AppHarness, user: str, **values: Any) -> None:
    assert harness.services.features is not None
    await harness.services.features.write_many([FeatureRow("acme", user, values)])


def stage(response_json: dict[str, Any], name: str) -> dict[str, Any]:
    stages = response_json["rag"]["explain"]["stages"]
    return next(s for s in stages if s["name"] == name)


# Where a test asserts what a lookup found, its budget is generous: on a busy test machine a
# 50 ms budget is sometimes spent before the event loop gets to the reply.
ROOMY = {"timeout_seconds": 2.0}


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url, features=ROOMY)) as h:
        yield h


async def test_language_and_tier_reach_the_prompt_after_the_fixed_instructions(
    make_app, redis_server, vllm
) -> None:
    settings = make_settings(
        redis_server.url, vllm.url, telemetry={"capture_content": True}, features=ROOMY
    )
    async with make_app(settings) as harness:
        await load(harness, "ann", language="pt", tier="pro")
        question = unique_question()
        answered = await harness.chat(await harness.key(user="ann"), body(question))
        assert answered.status_code == 200, answered.text
        chat = next(s for s in harness.exporter.get_finished_spans() if s.name.startswith("chat"))
        system = json.loads(chat.attributes["gen_ai.input.messages"])[0]
        assert system["role"] == "system"
        content = system["content"] if isinstance(system["content"], str) else json.dumps(system)
        assert "About the user: Answer in Portuguese. The user is on the pro plan." in content
        assert content.index("About the user") > content.index("You are a helpful assistant")

        harness.exporter.clear()
        plain = await harness.chat(await harness.key(user="noprofile"), body(unique_question()))
        assert plain.status_code == 200
        chat = next(s for s in harness.exporter.get_finished_spans() if s.name.startswith("chat"))
        assert "About the user" not in chat.attributes["gen_ai.input.messages"]


async def test_explain_shows_the_features_stage_with_used_and_defaulted_names(harness) -> None:
    await load(harness, "ann", tier="pro", department="sales")
    response = await harness.chat(
        await harness.key(user="ann"), body(unique_question(), rag={"explain": True})
    )
    assert response.status_code == 200, response.text
    data = response.json()
    features = stage(data, "features")
    assert features["status"] == "ok"
    assert features["info"]["features.lookup"] == "hit"
    assert features["info"]["features.defaulted"] == ["language", "request_count", "top_filter"]
    assert data["rag"]["features"]["defaulted"] == ["language", "request_count", "top_filter"]
    assert data["rag"]["features"]["used"] == sorted(SPECS)

    missing = await harness.chat(
        await harness.key(user="nobody"), body(unique_question(), rag={"explain": True})
    )
    info = stage(missing.json(), "features")["info"]
    assert (info["features.lookup"], info["features.defaulted"]) == ("miss", BATCH)
    span = next(s for s in harness.exporter.get_finished_spans() if s.name == "stage features")
    assert span.attributes[attr.FEATURES_LOOKUP] in ("hit", "miss")
    assert "pro" not in [str(v) for v in span.attributes.values()]  # names, never values


async def test_a_department_feature_becomes_a_default_retrieval_filter(harness) -> None:
    ingest_key = await harness.key(user="ops", scopes="chat,retrieve,ingest")
    ingested = await harness.client.post(
        "/v1/documents", json={"documents": DOCS}, headers={"Authorization": f"Bearer {ingest_key}"}
    )
    assert ingested.status_code == 200, ingested.text
    await load(harness, "ann", department="sales")
    # A fixed question: a random suffix moved engineering-0's cosine across the relevance
    # gate's threshold in 2% of runs (0.345 to 0.461 against 0.356 over 300 suffixes), and a
    # fresh-clone CI run failed so (2026-12-07). This one is 0.48 to 0.62 for all four.
    question = "What is the expense policy?"
    ask = body(question, rag={"explain": True, "top_k": 4})

    harness.exporter.clear()
    ann = (await harness.chat(await harness.key(user="ann"), ask)).json()
    assert {s["document_id"] for s in ann["rag"]["sources"]} == {"sales-0", "sales-1"}
    assert stage(ann, "retrieve")["info"]["retrieval.feature_filter"] == ["department"]
    retrieve = next(s for s in harness.exporter.get_finished_spans() if s.name == "stage retrieve")
    assert list(retrieve.attributes[attr.RETRIEVAL_FEATURE_FILTER]) == ["department"]

    bob = (await harness.chat(await harness.key(user="bob"), ask)).json()
    assert {s["document_id"].split("-")[0] for s in bob["rag"]["sources"]} == {
        "sales",
        "engineering",
    }
    assert "retrieval.feature_filter" not in stage(bob, "retrieve").get("info", {})

    # The request's own filter on the same key wins over the feature's default.
    mine = body(question, rag={"filters": {"department": "engineering"}, "top_k": 4})
    own = (await harness.chat(await harness.key(user="ann"), mine)).json()
    assert {s["document_id"] for s in own["rag"]["sources"]} == {"engineering-0", "engineering-1"}


async def test_two_users_of_a_tenant_no_longer_share_a_cached_answer(harness) -> None:
    assert harness.services.versions()["features"] == FEATURE_SET_VERSION
    request = body(unique_question())
    ann = await harness.key(user="ann")
    assert (await harness.chat(ann, request)).headers["x-cache"] == "miss"
    assert (await harness.chat(ann, request)).headers["x-cache"] == "hit"
    bob = await harness.chat(await harness.key(user="bob"), request)
    assert bob.status_code == 200
    assert bob.headers["x-cache"] == "miss"


async def test_with_features_off_users_of_a_tenant_share_cached_answers(
    make_app, redis_server, vllm
) -> None:
    settings = make_settings(redis_server.url, vllm.url, features={"enabled": False})
    async with make_app(settings) as harness:
        assert "features" not in harness.services.versions()
        request = body(unique_question(), rag={"explain": True})
        first = await harness.chat(await harness.key(user="ann"), request)
        assert first.headers["x-cache"] == "miss"
        assert "features" not in [s["name"] for s in first.json()["rag"]["explain"]["stages"]]
        other = await harness.chat(await harness.key(user="bob"), request)
        assert other.headers["x-cache"] == "hit"


async def test_redis_down_leaves_defaults_and_the_request_is_answered(make_app, vllm) -> None:
    redis = RedisServer()
    redis.start()
    settings = make_settings(redis.url, vllm.url, jobs={"workers": 0}, features=ROOMY)
    try:
        async with make_app(settings) as harness:
            key = await harness.key(user="ann")
            await load(harness, "ann", tier="pro")
            assert (await harness.chat(key, body(unique_question()))).status_code == 200
            redis.stop()
            down = await harness.chat(key, body(unique_question(), rag={"explain": True}))
            assert down.status_code == 200, down.text
            features = stage(down.json(), "features")
            assert features["status"] == "degraded"
            assert features["info"]["error_type"] == "StoreUnavailable"
            assert features["info"]["features.lookup"] == "error"
            assert down.json()["rag"]["features"]["defaulted"] == sorted(SPECS)
    finally:
        redis.stop()


async def test_a_lookup_past_its_budget_falls_back_and_the_request_goes_on(make_app, vllm) -> None:
    # A real slow Redis: its process stopped (SIGSTOP). The cache and the job workers are off,
    # so the features lookup is the only Redis call on the path (the key is cached in-process).
    redis = RedisServer()
    redis.start()
    settings = make_settings(
        redis.url,
        vllm.url,
        cache={"enabled": False},
        jobs={"workers": 0},
        redis={"timeout_seconds": 5.0},
        features={"timeout_seconds": 0.5},
    )
    try:
        async with make_app(settings) as harness:
            key = await harness.key(user="ann")
            await load(harness, "ann", tier="pro")
            warm = await harness.chat(key, body(unique_question(), rag={"explain": True}))
            assert stage(warm.json(), "features")["info"]["features.lookup"] == "hit"
            assert redis.process is not None
            os.kill(redis.process.pid, signal.SIGSTOP)
            try:
                slow = await harness.chat(key, body(unique_question(), rag={"explain": True}))
            finally:
                os.kill(redis.process.pid, signal.SIGCONT)
            assert slow.status_code == 200, slow.text
            features = stage(slow.json(), "features")
            assert (features["status"], features["info"]["error_type"]) == (
                "degraded",
                "StageTimeout",
            )
            assert features["info"]["features.lookup"] == "timeout"
            assert slow.json()["rag"]["features"]["defaulted"] == sorted(SPECS)
            again = await harness.chat(key, body(unique_question(), rag={"explain": True}))
            assert stage(again.json(), "features")["info"]["features.lookup"] == "hit"
    finally:
        redis.stop()
