"""``/metrics``: the families exist, requests move them by what they did, labels stay bounded."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import StoreUnavailable
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry.metrics import StageMetrics
from retrieval import Document
from tests.conftest import AppHarness, make_settings
from tests.support.servers import free_port

FAMILIES = {
    "rag_http_request_duration_seconds": "histogram",
    "rag_http_requests_in_flight": "gauge",
    "rag_stage_duration_seconds": "histogram",
    "rag_cache_lookups": "counter",
    "rag_retrieval_candidates": "histogram",
    "rag_retrieval_results": "histogram",
    "rag_llm_calls": "counter",
    "rag_llm_time_to_first_token_seconds": "histogram",
    "rag_llm_time_per_output_token_seconds": "histogram",
    "rag_llm_tokens": "counter",
    "rag_llm_errors": "counter",
    "rag_redis_errors": "counter",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(harness: AppHarness) -> tuple[str, Samples]:
    response = await harness.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return response.text, samples


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def chat(text: str, **extra: object) -> dict[str, object]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


async def test_every_family_is_served_in_prometheus_format(make_app, redis_server) -> None:
    settings = make_settings(redis_server.url, "http://127.0.0.1:9", retrieval={"enabled": False})
    async with make_app(settings) as harness:
        response = await harness.client.get("/metrics")
    types = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    assert {name: types.get(name) for name in FAMILIES} == FAMILIES
    assert "process_cpu_seconds" in types, "the process collectors are served too"


async def test_a_miss_and_a_hit_move_the_request_stage_cache_retrieval_and_model_metrics(
    make_app, redis_server, vllm
) -> None:
    text = f"What does vitamin D do for bones? (ref {uuid.uuid4().hex[:6]})"
    # The full path's hit, stage by stage (the fast path's metrics: tests/app/test_fastpath.py).
    settings = make_settings(redis_server.url, vllm.url, cache={"fast_path": False})
    async with make_app(settings) as harness:
        assert harness.services.retrieval is not None
        await harness.services.retrieval.ingest(
            "metrics", [Document(id="d", text="Vitamin D helps bones take up calcium.")]
        )
        key = await harness.key(tenant="metrics", user="metrics-user")
        _, before = await scrape(harness)
        miss = await harness.chat(key, chat(text))
        hit = await harness.chat(key, chat(text))
        page, after = await scrape(harness)
        stage_names = harness.paths.chat.stage_names
    assert miss.headers["x-cache"] == "miss" and hit.headers["x-cache"] == "hit"
    usage = miss.json()["usage"]

    route = {"method": "POST", "route": "/v1/chat/completions", "status": "200"}
    assert delta(before, after, "rag_http_request_duration_seconds_count", **route) == 2
    assert delta(before, after, "rag_http_request_duration_seconds_sum", **route) > 0
    for name in stage_names:
        count = delta(
            before, after, "rag_stage_duration_seconds_count", stage=name, status="ok"
        ) + delta(before, after, "rag_stage_duration_seconds_count", stage=name, status="degraded")
        ran_on_the_hit = name in stage_names[: stage_names.index("cache_lookup") + 1]
        assert count == (2 if ran_on_the_hit else 1), name
    assert delta(before, after, "rag_cache_lookups_total", outcome="miss") == 1
    assert delta(before, after, "rag_cache_lookups_total", outcome="hit") == 1
    assert delta(before, after, "rag_retrieval_candidates_count") == 1
    assert delta(before, after, "rag_retrieval_results_sum") == len(miss.json()["rag"]["sources"])

    model = {"model": "smollm2"}
    assert delta(before, after, "rag_llm_calls_total", outcome="ok", **model) == 1
    assert delta(before, after, "rag_llm_time_to_first_token_seconds_count", **model) == 1
    assert delta(before, after, "rag_llm_time_to_first_token_seconds_sum", **model) > 0
    assert delta(before, after, "rag_llm_time_per_output_token_seconds_count", **model) == (
        1 if usage["completion_tokens"] > 1 else 0
    )
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert delta(before, after, "rag_llm_tokens_total", type="prompt", **model) == prompt
    assert delta(before, after, "rag_llm_tokens_total", type="completion", **model) == completion
    assert "metrics-user" not in page and '"metrics"' not in page, "no tenant or user labels"


async def test_model_and_redis_failures_are_counted_by_kind(make_app, redis_server) -> None:
    settings = make_settings(redis_server.url, "http://127.0.0.1:9", retrieval={"enabled": False})
    nowhere = KeyValueStore.from_url(f"redis://127.0.0.1:{free_port()}/0", trace.NoOpTracer())
    async with make_app(settings) as harness:
        key = await harness.key()
        _, before = await scrape(harness)
        failed = await harness.chat(key, chat("hello"), **{"cache-control": "no-cache"})
        for _ in range(2):  # refused, then skipped while the circuit is open
            with pytest.raises(StoreUnavailable):
                await nowhere.get("anything")
        _, after = await scrape(harness)
    await nowhere.aclose()
    assert failed.status_code == 503
    errors = {"model": "smollm2", "kind": "upstream_unavailable"}
    assert delta(before, after, "rag_llm_errors_total", **errors) == 1
    assert delta(before, after, "rag_llm_calls_total", model="smollm2", outcome="error") == 1
    for kind in ("ConnectionError", "circuit_open"):
        assert delta(before, after, "rag_redis_errors_total", command="GET", kind=kind) == 1
    status = {"method": "POST", "route": "/v1/chat/completions", "status": "503"}
    assert delta(before, after, "rag_http_request_duration_seconds_count", **status) == 1


async def test_metrics_can_be_switched_off(make_app, redis_server) -> None:
    settings = make_settings(
        redis_server.url,
        "http://127.0.0.1:9",
        retrieval={"enabled": False},
        telemetry={"metrics": False},
    )
    async with make_app(settings) as harness:
        assert (await harness.client.get("/metrics")).status_code == 404
        observers = harness.paths.chat.observers
        assert not any(isinstance(o, StageMetrics) for o in observers)


async def test_with_a_token_metrics_answer_that_token_only(make_app, redis_server) -> None:
    token = "7e3f" * 8
    settings = make_settings(
        redis_server.url,
        "http://127.0.0.1:9",
        retrieval={"enabled": False},
        telemetry={"metrics_token": token},
    )
    async with make_app(settings) as harness:
        api_key = await harness.key()
        scraped = await harness.client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        refused = [
            await harness.client.get("/metrics", headers=headers)
            for headers in (
                {},
                {"Authorization": f"Bearer {token[:-1]}0"},
                {"Authorization": f"Bearer {token}{token}"},
                {"Authorization": f"Basic {token}"},
                {"Authorization": token},
                {"Authorization": "Bearer ünïcode".encode("latin-1")},
                # An API key, however valid, is not the metrics token.
                {"Authorization": f"Bearer {api_key}"},
            )
        ]
    assert scraped.status_code == 200
    assert "rag_http_request_duration_seconds" in scraped.text
    for response in refused:
        assert response.status_code == 401
        assert response.json() == {
            "error": {
                "message": "Invalid or missing metrics token.",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert "rag_" not in response.text


async def test_requests_answered_before_routing_are_labelled_route_none(
    make_app, redis_server
) -> None:
    settings = make_settings(redis_server.url, "http://127.0.0.1:9", retrieval={"enabled": False})
    async with make_app(settings) as harness:
        key = await harness.key()
        auth = {"Authorization": f"Bearer {key}"}
        _, before = await scrape(harness)
        no_key = await harness.chat(None, chat("hello"))
        no_key_unknown_path = await harness.client.get("/v1/nope")
        too_large = await harness.client.post(
            "/v1/chat/completions", content=b"x" * 2_000_000, headers=auth
        )
        invalid = await harness.chat(key, {"model": "smollm2"})  # refused by the route itself
        unknown_path = await harness.client.get("/v1/nope", headers=auth)
        _, after = await scrape(harness)
    answers = (no_key, no_key_unknown_path, too_large, invalid, unknown_path)
    assert [r.status_code for r in answers] == [401, 401, 413, 400, 404]

    def count(method: str, route: str, status: int) -> float:
        labels = {"method": method, "route": route, "status": str(status)}
        return delta(before, after, "rag_http_request_duration_seconds_count", **labels)

    # The key check and the size check answer before the router runs: no route ran.
    assert count("POST", "none", 401) == 1 and count("GET", "none", 401) == 1
    assert count("POST", "none", 413) == 1
    assert count("POST", "/v1/chat/completions", 401) == 0
    assert count("POST", "/v1/chat/completions", 413) == 0
    assert count("GET", "unmatched", 401) == 0, "a path is unmatched only if the router says so"
    # The route ran and refused the body; the router found no route for the path.
    assert count("POST", "/v1/chat/completions", 400) == 1
    assert count("GET", "unmatched", 404) == 1
