"""Fewer tokens through the service, against the real vLLM and the real embedder: the relevance
gate leaves an off-topic question without sources, and compression cuts the sources to a budget
while keeping their citations."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import chat_request, make_settings, unique_question

BIRDS = [
    {
        "id": "kea",
        "title": "Kea",
        "text": (
            "The kea is a large parrot found in the forested and alpine regions of the South "
            "Island of New Zealand. Kea are known for their intelligence and curiosity. They "
            "eat roots, leaves, berries, nectar and insects. The species is classed as "
            "endangered, and its numbers have fallen because of introduced predators. Kea nest "
            "in holes in the ground among the roots of trees. A kea can live for 20 years. "
        )
        * 3,
    },
    {
        "id": "kakapo",
        "title": "Kakapo",
        "text": (
            "The kakapo is a flightless, nocturnal parrot endemic to New Zealand. It is the "
            "heaviest parrot in the world, and breeds only when the rimu trees fruit heavily. "
            "Every kakapo alive is named and tracked by the conservation programme. Kakapo "
            "males gather in leks and boom to attract females over several kilometres. "
        )
        * 3,
    },
]


def body(question: str, **rag: Any) -> dict[str, Any]:
    return chat_request(question, max_tokens=4, rag={"explain": True, **rag})


def stage(response: Any, name: str) -> dict[str, Any]:
    stages = response.json()["rag"]["explain"]["stages"]
    return next(s for s in stages if s["name"] == name)


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        writer = await h.key(scopes="chat,retrieve,ingest")
        response = await h.client.post(
            "/v1/documents",
            json={"documents": BIRDS},
            headers={"Authorization": f"Bearer {writer}"},
        )
        assert response.status_code == 200, response.text
        yield h


async def test_an_off_topic_question_runs_without_sources(harness) -> None:
    key = await harness.key()
    off = await harness.chat(key, body(f"What is the capital of France? {unique_question()[-8:]}"))
    retrieve = stage(off, "retrieve")["info"]
    assert off.json()["rag"]["sources"] == []
    assert retrieve["retrieval.no_sources"] is True and retrieve["retrieval.dropped"] >= 1
    on = await harness.chat(key, body(f"Where do kea parrots live? {unique_question()[-8:]}"))
    assert on.json()["rag"]["sources"][0]["document_id"] == "kea"
    assert stage(on, "retrieve")["info"]["retrieval.no_sources"] is False
    # The request may lower the bar: then the least irrelevant passages come back.
    forced = await harness.chat(key, body("What is the capital of France?", min_relevance=0.0))
    assert forced.json()["rag"]["sources"]


async def test_compression_keeps_the_sources_under_the_budget_with_fewer_tokens(harness) -> None:
    key = await harness.key()
    question = f"Why are kea parrots endangered, and where do kakapo nest? {unique_question()[-8:]}"
    full = await harness.chat(key, body(question, compress=False, min_relevance=0.0))
    short = await harness.chat(key, body(question, budget_tokens=120, min_relevance=0.0))
    assert stage(full, "compress")["info"]["compress.skipped"] == "off"
    info = stage(short, "compress")["info"]
    assert info["compress.tokens_after"] <= 120 < info["compress.tokens_before"]
    # The same sources are cited either way; the model is sent fewer tokens.
    assert {s["document_id"] for s in short.json()["rag"]["sources"]} == {"kea", "kakapo"}
    tokens = full.json()["usage"]["prompt_tokens"], short.json()["usage"]["prompt_tokens"]
    assert tokens[1] < tokens[0] - 100, tokens
