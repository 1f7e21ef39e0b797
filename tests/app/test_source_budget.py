"""Sources always fit the window, through the service against the real vLLM (2,048 tokens) and a
real index of SciFact abstracts: eight uncompressed abstracts and a 512-token answer do not fit,
so the weakest are dropped (and said so in ``rag.explain``) instead of the request failing; a
request whose own messages do not fit still gets ``context_length_exceeded``."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from tests.conftest import chat_request, make_settings
from tests.support.data import open_scifact

DOCUMENTS = 40


def scifact_documents(count: int) -> list[dict[str, Any]]:
    with open_scifact("corpus.jsonl") as f:
        rows = [json.loads(line) for line in itertools.islice(f, count)]
    return [{"id": r["_id"], "title": r["title"], "text": r["text"]} for r in rows]


def generate_info(response: Any) -> dict[str, Any]:
    stages = response.json()["rag"]["explain"]["stages"]
    return next(s for s in stages if s["name"] == "generate").get("info", {})


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        writer = await h.key(scopes="chat,retrieve,ingest")
        response = await h.client.post(
            "/v1/documents",
            json={"documents": scifact_documents(DOCUMENTS)},
            headers={"Authorization": f"Bearer {writer}"},
        )
        assert response.status_code == 200, response.text
        yield h


async def test_eight_uncompressed_sources_and_a_long_answer_are_fitted_not_refused(
    harness,
) -> None:
    key = await harness.key()
    question = "How do mutations in cancer cells and the immune response affect tumour growth?"
    body = chat_request(
        question,
        max_tokens=512,
        stop=["."],  # a sentence is enough: the room the answer may take is what is tested
        rag={"top_k": 8, "compress": False, "explain": True, "min_relevance": 0.0},
    )
    response = await harness.chat(key, body, **{"Cache-Control": "no-cache, no-store"})
    assert response.status_code == 200, response.text
    rag = response.json()["rag"]
    info = generate_info(response)
    dropped = info["prompt.sources_dropped"]
    assert dropped, info
    kept = [s["chunk_id"] for s in rag["sources"]]
    assert kept and len(kept) + len(dropped) == 8
    assert not set(kept) & set(dropped)
    # Every dropped one ranked below every kept one.
    assert 0 < info["prompt.source_tokens"] <= info["prompt.source_budget"]
    # Citations point only at what the prompt held.
    cited = {s["chunk_id"] for c in rag["citations"] for s in c["sources"]}
    assert cited <= set(kept)
    # The window was used, not wasted: the prompt and the answer's room near 2,048 tokens.
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert 2048 - 250 <= prompt_tokens + 512 <= 2048, prompt_tokens


async def test_sources_that_fit_are_all_kept_and_nothing_is_said_dropped(harness) -> None:
    key = await harness.key()
    body = chat_request(
        "What do T cells do in tumours?",
        max_tokens=8,
        rag={"top_k": 3, "compress": True, "explain": True, "min_relevance": 0.0},
    )
    response = await harness.chat(key, body, **{"Cache-Control": "no-cache, no-store"})
    assert response.status_code == 200, response.text
    info = generate_info(response)
    assert len(response.json()["rag"]["sources"]) == 3
    assert "prompt.sources_dropped" not in info and info["prompt.source_budget"] > 0


async def test_a_request_whose_own_messages_exceed_the_window_is_still_refused(harness) -> None:
    key = await harness.key()
    long = "Why do tumours grow? " + "Tell me more about cells and their growth. " * 300
    body = chat_request(
        long, max_tokens=64, rag={"top_k": 8, "compress": False, "min_relevance": 0.0}
    )
    response = await harness.chat(key, body, **{"Cache-Control": "no-cache, no-store"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
