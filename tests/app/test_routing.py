"""Routing through the whole service, against the real vLLM: two routes on the one server,
each with its own client and concurrency bound; the choice in ``rag.route``, on the spans and
in the cache key."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

from app.path import build_paths
from app.services import Services
from pipeline.telemetry import attributes as attr
from retrieval import Embedder
from tests.conftest import chat_request, make_settings
from tests.support.faultproxy import FaultProxy


def routing(url: str, small_limit: int = 1, large_limit: int = 4) -> dict[str, Any]:
    return {
        # Roomy: on a busy test machine embedding one query can take longer than the default
        # 250 ms, and these tests are about what the router decides, not how fast.
        "timeout_seconds": 10.0,
        "routes": {
            "small": {"base_url": url, "model": "smollm2", "max_concurrency": small_limit},
            "large": {"base_url": url, "model": "smollm2", "max_concurrency": large_limit},
        },
    }


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url, routing=routing(vllm.url))) as h:
        yield h


def body(text: str, *, model: str = "auto", max_tokens: int = 8, **rag: Any) -> dict[str, Any]:
    return chat_request(text, model=model, max_tokens=max_tokens, rag={"explain": True, **rag})


def route_record(answer: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = next(
        r for r in answer["rag"]["explain"]["stages"] if r["name"] == "route"
    )
    return record


def ref() -> str:
    return uuid.uuid4().hex[:6]


def spans_named(harness: Any, name: str) -> list[ReadableSpan]:
    return [s for s in harness.exporter.get_finished_spans() if s.name == name]


async def test_the_chosen_route_and_reason_show_in_rag_and_on_the_spans(harness) -> None:
    cases = [
        (f"Translate 'good morning' into French. ({ref()})", "small", "rule:translate"),
        (f"Explain step by step how a bicycle gear works. ({ref()})", "large", "rule:step_by_step"),
    ]
    for text, name, reason in cases:
        harness.exporter.clear()
        key = await harness.key()
        response = await harness.chat(key, body(text))
        assert response.status_code == 200, response.text
        assert response.json()["rag"]["route"] == {
            "name": name,
            "model": "smollm2",
            "reason": reason,
        }
        stage = spans_named(harness, "stage route")[0]
        assert stage.attributes[attr.ROUTE] == name
        assert stage.attributes[attr.ROUTE_REASON] == reason
        # Generation went to the chosen route.
        chat = spans_named(harness, "chat smollm2")[0]
        assert chat.attributes[attr.ROUTE] == name
        assert route_record(response.json())["info"] == {"route": name, "route.reason": reason}


async def test_an_open_request_is_routed_by_the_query_embedding(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, body(f"A baleia é um mamífero ({ref()})?"))
    assert response.status_code == 200, response.text
    route = response.json()["rag"]["route"]
    assert route["name"] == "small" and route["reason"].startswith("centroid:small (")


async def test_pinning_by_option_or_by_model_name(harness) -> None:
    key = await harness.key()
    small_ask = f"What is the capital of Peru? ({ref()})"
    pinned = await harness.chat(key, body(small_ask, route="large"))
    by_name = await harness.chat(key, body(small_ask, model="large"))
    for response in (pinned, by_name):
        assert response.status_code == 200, response.text
        assert response.json()["rag"]["route"] == {
            "name": "large",
            "model": "smollm2",
            "reason": "pinned",
        }
        assert response.json()["model"] == "smollm2"


async def test_an_unknown_route_is_a_400_in_openai_shape(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, body("What is the capital of Peru?", route="huge"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "rag.route" and error["code"] == "unknown_route"
    assert "huge" in error["message"] and "large" in error["message"]


async def test_the_route_is_part_of_the_cache_key(harness) -> None:
    key = await harness.key()
    text = f"What is the capital of Chile? ({ref()})"
    first = await harness.chat(key, body(text, route="small"))
    again = await harness.chat(key, body(text, route="small"))
    other = await harness.chat(key, body(text, route="large"))
    assert [r.json()["rag"]["cache"] for r in (first, again, other)] == ["miss", "hit", "miss"]
    assert again.json()["rag"]["route"]["name"] == "small"
    assert other.json()["rag"]["route"]["name"] == "large"


async def test_a_failed_embedding_falls_back_to_the_default_route_and_answers(
    make_app, redis_server, vllm, shared_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tenant without the injection guard: the similarity check, which needs the same
    # embedder, fails closed (a 503, next test); routing degrades to the default route.
    policy = json.dumps({"open": {"injection": "allow"}})
    settings = make_settings(
        redis_server.url, vllm.url, routing=routing(vllm.url), guard={"policy": policy}
    )
    async with make_app(settings) as harness:

        def broken(texts: list[str]) -> Any:
            raise RuntimeError("embedding model unavailable")

        # The centroids were embedded at start-up; from now on the query embedder fails.
        monkeypatch.setattr(shared_embedder, "embed", broken)
        key = await harness.key("open")
        request = body(f"A baleia é um mamífero ({ref()})?")
        response = await harness.chat(key, request)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        assert response.json()["rag"]["route"] == {
            "name": "small",
            "model": "smollm2",
            "reason": "fallback:ServiceUnavailable: The embedding model failed (RuntimeError).",
        }
        assert route_record(response.json())["status"] == "degraded"
        # An answer made with a stage degraded is not kept under the key of a routed answer.
        again = await harness.chat(key, request)
        assert again.json()["rag"]["cache"] == "miss"
        # With the injection guard on, a question the similarity check cannot judge is
        # refused, never answered unchecked.
        guarded = await harness.chat(await harness.key("guarded"), request)
        assert guarded.status_code == 503, guarded.text


def first_chunk_and_end(span: ReadableSpan) -> tuple[float, float]:
    """When the span's stream gave its first chunk, and when it ended (seconds)."""
    assert span.start_time is not None and span.end_time is not None
    first = span.start_time / 1e9 + float(
        span.attributes[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    )
    return first, span.end_time / 1e9


async def two_at_once(harness: Any, route: str) -> list[tuple[float, float]]:
    key = await harness.key()
    harness.exporter.clear()
    asks = [
        body(f"Write a long story about a dragon. ({ref()})", max_tokens=32, route=route)
        for _ in range(2)
    ]
    responses = await asyncio.gather(*(harness.chat(key, ask) for ask in asks))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    spans = spans_named(harness, "chat smollm2")
    assert [s.attributes[attr.ROUTE] for s in spans] == [route, route]
    return sorted(first_chunk_and_end(s) for s in spans)


async def test_each_route_has_its_own_client_and_concurrency_bound(
    make_app, redis_server, vllm
) -> None:
    with FaultProxy(vllm.url) as llm:
        settings = make_settings(redis_server.url, vllm.url, routing=routing(llm.url))
        async with make_app(settings) as harness:
            routes = harness.services.routes
            assert routes.get("small").client is not routes.get("large").client
            assert routes.get("small").client.client is not routes.get("large").client.client

            # small allows one request at a time: the second one's stream starts after the
            # first ends (the slot is given back before the second can reach the model).
            (_, first_end), (second_first_chunk, _) = await two_at_once(harness, "small")
            assert second_first_chunk >= first_end, "two requests ran at once on a route of 1"

            # large allows four: with the model server's side of the proxy paused, neither
            # request can end, so both held there at once is two in flight at once (a route
            # that serialised them would never send the second: the wait below times out).
            key = await harness.key()
            llm.pause()
            try:
                asks = [
                    asyncio.create_task(
                        harness.chat(key, body(f"Dragons? ({ref()})", route="large"))
                    )
                    for _ in range(2)
                ]
                both = await asyncio.to_thread(
                    llm.holding_requests, b"/v1/chat/completions", 2, 60.0
                )
            finally:
                llm.passing()
            responses = await asyncio.gather(*asks)
            assert both, "large serialised its requests: the second never reached the model"
            assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]


def built(settings: Any) -> Services:
    return Services.build(settings, TracerProvider().get_tracer("test"))


async def test_the_route_stage_is_on_the_path_only_when_there_is_a_choice(redis_server) -> None:
    url = "http://127.0.0.1:9"  # nothing is sent: only the path is built
    no_retrieval = {"enabled": False}
    cases = [
        ({"routing": routing(url)}, True),
        ({"routing": {**routing(url), "enabled": False}}, False),
        ({"routing": {"routes": {"only": {"base_url": url, "model": "smollm2"}}}}, False),
    ]
    for groups, expected in cases:
        services = built(make_settings(redis_server.url, url, retrieval=no_retrieval, **groups))
        try:
            chat = build_paths(services.settings, services).chat
            assert ("route" in chat.stage_names) is expected, groups
            assert (services.router is not None) is expected
            if services.router is not None:
                # Retrieval off: no embedder, so the router decides by rules (and length) alone.
                assert services.router.centroids is None
                assert services.versions()["router"] == services.router.version
        finally:
            await services.aclose()


async def test_route_names_the_router_needs_must_exist(redis_server) -> None:
    url = "http://127.0.0.1:9"
    odd = {
        "routes": {
            "fast": {"base_url": url, "model": "m"},
            "smart": {"base_url": url, "model": "m"},
        }
    }
    settings = make_settings(redis_server.url, url, retrieval={"enabled": False}, routing=odd)
    with pytest.raises(ValueError, match="not configured: large, small"):
        built(settings)
    mapped = {**odd, "small_route": "fast", "large_route": "smart"}
    settings = make_settings(redis_server.url, url, retrieval={"enabled": False}, routing=mapped)
    services = built(settings)
    try:
        assert services.router is not None
        assert services.router.policy.intents == {"small": "fast", "large": "smart"}
    finally:
        await services.aclose()
