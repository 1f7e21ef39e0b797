"""A follow-up question retrieves with the conversation (issue 17): "And how does the season
change it?" after a question about vitamin D finds the vitamin D sources, and a question on a
new topic is not pulled back to the old one. Real embedding model, real Redis, the dev vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from tests.app.test_retrieval_api import ingest
from tests.conftest import make_settings

ABSTRACTS = [
    {
        "id": "vitd-skin",
        "title": "Cutaneous synthesis of vitamin D3",
        "text": "Vitamin D3 is produced in the skin when 7-dehydrocholesterol absorbs ultraviolet "
        "B radiation. The amount made depends on environmental factors such as latitude, "
        "altitude, air pollution and time of day, and on skin pigmentation and age.",
    },
    {
        "id": "vitd-season",
        "title": "Seasonal variation in vitamin D status",
        "text": "In winter months at northern latitudes little ultraviolet B reaches the ground, "
        "so cutaneous vitamin D3 production falls to near zero; serum 25-hydroxyvitamin D "
        "concentrations peak in late summer and reach their lowest in late winter and spring.",
    },
    {
        "id": "statins",
        "title": "Statin therapy and LDL cholesterol",
        "text": "In a randomised trial, statins lowered LDL cholesterol by a third and reduced "
        "major cardiovascular events in patients at high risk.",
    },
    {
        "id": "malaria",
        "title": "Insecticide-treated bed nets and malaria",
        "text": "Distribution of treated nets reduced childhood malaria incidence and mortality "
        "in sub-Saharan Africa.",
    },
    {
        "id": "sleep",
        "title": "Shift work and sleep",
        "text": "Night shift workers slept less and reported more fatigue than day workers.",
    },
]
VITAMIN_D = {"vitd-skin", "vitd-season"}
FIRST = "What environmental factors influence how much vitamin D the skin makes?"
FOLLOW_UP = "And how does the season change it?"


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        yield h


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "rag": {"top_k": 3, "explain": True},
    }


def retrieve_info(answer: dict[str, Any]) -> dict[str, Any]:
    stage = next(s for s in answer["rag"]["explain"]["stages"] if s["name"] == "retrieve")
    info: dict[str, Any] = stage["info"]
    return info


async def ask(harness, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = await harness.chat(key, body(messages))
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_a_follow_up_retrieves_with_the_conversation(harness) -> None:
    key = await harness.key(scopes="chat,retrieve,ingest")
    await ingest(harness, key, ABSTRACTS)
    first = await ask(harness, key, [{"role": "user", "content": FIRST}])
    assert {s["document_id"] for s in first["rag"]["sources"]} <= VITAMIN_D
    assert first["rag"]["sources"], "the first question finds the vitamin D abstracts"

    # Alone, the follow-up is about nothing the index holds: the gate leaves it no source.
    alone = await ask(harness, key, [{"role": "user", "content": FOLLOW_UP}])
    assert alone["rag"]["sources"] == []

    reply = first["choices"][0]["message"]["content"]
    harness.exporter.clear()
    follow_up = await ask(
        harness,
        key,
        [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": FOLLOW_UP},
        ],
    )
    sources = [s["document_id"] for s in follow_up["rag"]["sources"]]
    assert "vitd-season" in sources, sources
    assert set(sources) <= VITAMIN_D
    assert retrieve_info(first)["retrieval.query.mode"] == "last_message"
    info = retrieve_info(follow_up)
    assert info["retrieval.query.mode"] == "conversation"
    assert info["retrieval.query.reason"] == "opener"
    assert info["retrieval.query.earlier_turns"] == 1
    assert info["retrieval.no_sources"] is False
    span = next(s for s in harness.exporter.get_finished_spans() if s.name == "stage retrieve")
    assert span.attributes["rag.retrieval.query.mode"] == "conversation"
    assert span.attributes["rag.retrieval.query.earlier_turns"] == 1


@pytest.mark.parametrize(
    "question",
    [
        "Do statins lower LDL cholesterol in patients at high risk?",
        "Different question: do bed nets reduce malaria in children?",
    ],
)
async def test_a_topic_shift_does_not_retrieve_the_earlier_topic_first(
    harness, question: str
) -> None:
    key = await harness.key(scopes="chat,retrieve,ingest")
    await ingest(harness, key, ABSTRACTS)
    answer = await ask(
        harness,
        key,
        [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": "Latitude, season and skin pigmentation [1]."},
            {"role": "user", "content": "Does it depend on age too?"},
            {"role": "assistant", "content": "Yes, older skin makes less [1]."},
            {"role": "user", "content": question},
        ],
    )
    sources = [s["document_id"] for s in answer["rag"]["sources"]]
    assert sources, "the new question has sources of its own"
    assert sources[0] not in VITAMIN_D, sources
    assert sources[0] in {"statins", "malaria"}
    info = retrieve_info(answer)
    assert info["retrieval.query.mode"] == "last_message"
    assert info["retrieval.query.reason"] in {"standalone", "topic_shift"}
