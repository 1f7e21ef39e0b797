"""`/v1/retrieve` and chat's retrieval agree (issue 15): the same `top_k` bounds, the same
relevance gate with the same default threshold, filter errors naming the field of the route
called, each source's relevance beside its score, and explain's count of what each filter and
the gate kept out. Real Redis and the real embedder; the real vLLM where a chat is answered."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pipeline.features.store import FeatureRow
from tests.app.test_errors import assert_openai_error
from tests.app.test_retrieval_api import DOCS, auth, ingest, search
from tests.conftest import AppHarness, chat_request, make_settings
from tests.support.servers import free_port

BIRD = "Which bird is flightless?"
BAD_FILTER = {"year": {"$between": [1, 2]}}

# One chunk each: two departments, each with two policies and an FAQ.
HANDBOOK = [
    {
        "id": f"{department}-{kind}-{n}",
        "title": f"{department.title()} {kind} {n}",
        "text": f"Expense {kind} of the {department} team, part {n}: {text}",
        "metadata": {"department": department, "kind": kind},
    }
    for department in ("sales", "engineering")
    for n, (kind, text) in enumerate(
        [
            ("policy", "travel expenses are refunded within a week."),
            ("policy", "meals with clients need a manager's approval."),
            ("faq", "receipts can be photographed with the phone app."),
        ]
    )
]


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    async with make_app(settings) as h:
        yield h


def asked(question: str) -> str:
    return f"{question} (ref {uuid.uuid4().hex[:6]})"


def retrieve_info(response_json: dict[str, Any]) -> dict[str, Any]:
    stages = response_json["rag"]["explain"]["stages"]
    info: dict[str, Any] = next(s for s in stages if s["name"] == "retrieve")["info"]
    return info


async def test_retrieve_refuses_a_top_k_past_chats_bound_of_50(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    await ingest(harness, key, DOCS)
    for top_k in (0, 51, 100):
        response = await harness.client.post(
            "/v1/retrieve", json={"query": "kiwi", "top_k": top_k}, headers=auth(key)
        )
        assert assert_openai_error(response, 400, "invalid_request_error")["param"] == "top_k"
    assert len((await search(harness, key, "kiwi", top_k=50, min_relevance=0))["data"]) == 3


async def test_retrieve_gates_results_by_min_relevance_as_chat_does(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    await ingest(harness, key, DOCS)
    everything = await search(harness, key, BIRD, top_k=3, min_relevance=0)
    relevance = {h["document_id"]: h["relevance"] for h in everything["data"]}
    assert len(relevance) == 3 and all(0 < r < 1 for r in relevance.values())
    assert everything["dropped"] == 0

    # By default the server's threshold applies, as for chat's rag.min_relevance.
    threshold = harness.services.settings.retrieval.relevance_threshold
    gated = await search(harness, key, BIRD, top_k=3)
    assert [h["document_id"] for h in gated["data"]] == ["kiwi-1"]
    assert all(relevance[d] < threshold for d in relevance.keys() - {"kiwi-1"})
    assert gated["dropped"] == 2

    # The gate compares the relevance shown, not the fused score.
    best = gated["data"][0]
    assert best["score"] != best["relevance"]
    strict = await search(harness, key, BIRD, top_k=3, min_relevance=best["relevance"] + 1e-6)
    assert strict["data"] == [] and strict["dropped"] == 3
    just = await search(harness, key, BIRD, top_k=3, min_relevance=best["relevance"])
    assert [h["document_id"] for h in just["data"]] == ["kiwi-1"]

    for bad in (-0.1, 1.5, "high"):
        response = await harness.client.post(
            "/v1/retrieve", json={"query": BIRD, "min_relevance": bad}, headers=auth(key)
        )
        error = assert_openai_error(response, 400, "invalid_request_error")
        assert error["param"] == "min_relevance"


async def test_retrieve_defaults_to_the_servers_relevance_threshold(make_app, redis_server) -> None:
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        retrieval={"relevance_threshold": 0.99},
    )
    async with make_app(settings) as harness:
        key = await harness.key(scopes="retrieve,ingest")
        await ingest(harness, key, DOCS)
        strict = await search(harness, key, BIRD, top_k=3)
        assert strict["data"] == [] and strict["dropped"] == 3
        relaxed = await search(harness, key, BIRD, top_k=3, min_relevance=0)
        assert len(relaxed["data"]) == 3


async def test_an_invalid_filter_names_the_field_of_the_route_called(harness) -> None:
    key = await harness.key(scopes="chat,retrieve,ingest")
    await ingest(harness, key, DOCS)
    retrieve = await harness.client.post(
        "/v1/retrieve", json={"query": "kiwi", "filters": BAD_FILTER}, headers=auth(key)
    )
    error = assert_openai_error(retrieve, 400, "invalid_request_error")
    assert error["param"] == "filters"
    assert error["message"].startswith("Invalid filters:") and "$between" in error["message"]

    chat = await harness.chat(key, chat_request(asked(BIRD), rag={"filters": BAD_FILTER}))
    error = assert_openai_error(chat, 400, "invalid_request_error")
    assert error["param"] == "rag.filters"
    assert error["message"].startswith("Invalid rag.filters:") and "$between" in error["message"]


async def test_chat_sources_carry_the_relevance_that_retrieve_reports_and_the_gate_reads(
    make_app, redis_server, vllm
) -> None:
    async with make_app(make_settings(redis_server.url, vllm.url)) as harness:
        key = await harness.key(scopes="chat,retrieve,ingest")
        await ingest(harness, key, DOCS)
        question = asked(BIRD)
        found = await search(harness, key, question, top_k=3, min_relevance=0)
        expected = {h["chunk_id"]: round(h["relevance"], 6) for h in found["data"]}
        rag = {"top_k": 3, "min_relevance": 0, "compress": False, "explain": True}
        answered = await harness.chat(key, chat_request(question, rag=rag))
        assert answered.status_code == 200, answered.text
        sources = answered.json()["rag"]["sources"]
        assert {s["chunk_id"]: s["relevance"] for s in sources} == expected
        assert all(s["score"] != s["relevance"] for s in sources)

        # One threshold above every source's relevance: chat and retrieve both keep none.
        above = max(expected.values()) + 1e-3
        gated = await harness.chat(key, chat_request(question, rag={**rag, "min_relevance": above}))
        assert gated.json()["rag"]["sources"] == []
        info = retrieve_info(gated.json())
        assert (info["retrieval.dropped"], info["retrieval.no_sources"]) == (3, True)
        none = await search(harness, key, question, top_k=3, min_relevance=above)
        assert none["data"] == [] and none["dropped"] == 3


async def load(harness: AppHarness, user: str, **values: Any) -> None:
    assert harness.services.features is not None
    await harness.services.features.write_many([FeatureRow("acme", user, values)])


async def test_explain_counts_what_the_filter_the_feature_filter_and_the_gate_kept_out(
    make_app, redis_server, vllm
) -> None:
    settings = make_settings(redis_server.url, vllm.url, features={"timeout_seconds": 2.0})
    async with make_app(settings) as harness:
        ops = await harness.key(user="ops", scopes="chat,retrieve,ingest")
        assert (await ingest(harness, ops, HANDBOOK))["chunks"] == 6
        await load(harness, "ann", department="sales")
        ann, bob = await harness.key(user="ann"), await harness.key(user="bob")

        async def explain(key: str, **rag: Any) -> dict[str, Any]:
            options = {"explain": True, "top_k": 6, "compress": False, **rag}
            body = chat_request(asked("What is the expense policy?"), rag=options)
            response = await harness.chat(key, body)
            assert response.status_code == 200, response.text
            return retrieve_info(response.json())

        def counts(info: dict[str, Any]) -> tuple[int, ...]:
            keys = ("allowed", "excluded.filters", "excluded.feature_filter", "dropped")
            return tuple(info[f"retrieval.{k}"] for k in keys)

        policies = {"kind": "policy"}
        # Of 6 chunks, the request's filter keeps out the 2 FAQs; ann's department filter
        # keeps out the 2 engineering policies of the other 4; the gate set to 0 drops none.
        info = await explain(ann, filters=policies, min_relevance=0)
        assert counts(info) == (2, 2, 2, 0) and info["retrieval.results"] == 2
        assert info["retrieval.feature_filter"] == ["department"]
        # The same search with a threshold no passage reaches: the gate drops both.
        info = await explain(ann, filters=policies, min_relevance=0.999)
        assert counts(info) == (2, 2, 2, 2) and info["retrieval.no_sources"] is True
        # Bob has no department: no feature filter.
        info = await explain(bob, filters=policies, min_relevance=0)
        assert counts(info) == (4, 2, 0, 0)
        assert "retrieval.feature_filter" not in info
        # The request's own department wins over ann's: the feature filter is not applied.
        info = await explain(ann, filters={"department": "engineering"}, min_relevance=0)
        assert counts(info) == (3, 3, 0, 0)
        assert "retrieval.feature_filter" not in info
