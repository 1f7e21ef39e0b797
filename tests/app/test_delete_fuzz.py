"""POST /v1/documents/delete with generated bodies: never a 5xx, errors in OpenAI's shape, a
refused body deletes nothing, and an accepted one deletes exactly the tenant's documents it
names and lists the others in `not_found`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.main import create_app
from tests.conftest import AppHarness, make_settings
from tests.support.fuzzing import examples
from tests.support.servers import free_port
from tests.support.strategies import json_values

TENANT = "deletes"
IDS = ["a", "b", "c", "notes/d.md", "e%20f"]
DOCUMENTS = [{"id": i, "text": f"Document {i} is about tides and the moon."} for i in IDS]
JSON = json_values(
    text_size=12,
    key_size=8,
    list_size=4,
    dict_size=3,
    allow_nan=False,
    allow_infinity=False,
    max_leaves=8,
)
AN_ID = st.sampled_from([*IDS, "nope", "A", "a ", "a#1", "", "x" * 257, "\u200b"]) | st.text(
    max_size=10
)
BODIES = (
    st.fixed_dictionaries({"ids": st.lists(AN_ID | JSON, max_size=6) | JSON})
    | st.fixed_dictionaries(
        {"ids": st.lists(AN_ID, min_size=1, max_size=3)},
        optional={"filter": JSON, "Ids": JSON},
    )
    | JSON
)


@pytest.fixture(scope="module")
async def fuzzed(redis_server, shared_embedder) -> AsyncIterator[tuple[AppHarness, str]]:
    config = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    app = create_app(config, embedder=shared_embedder)
    async with app.router.lifespan_context(app):
        harness = AppHarness(app, exporter=None)  # type: ignore[arg-type]
        key = await harness.key(tenant=TENANT, scopes="retrieve,ingest")
        try:
            yield harness, key
        finally:
            await harness.client.aclose()


async def held(harness: AppHarness) -> set[str]:
    search = harness.services.retrieval
    assert search is not None
    return search.backend(TENANT).document_ids(TENANT)


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BODIES)
@example(body={"ids": ["a", "nope", "a", "notes/d.md"]})
@example(body={"ids": []})
@example(body={"ids": ["a"], "filter": {"topic": "x"}})
async def test_generated_delete_bodies_never_get_a_5xx_and_delete_only_what_they_name(
    fuzzed: tuple[AppHarness, str], body: Any
) -> None:
    harness, key = fuzzed
    headers = {"Authorization": f"Bearer {key}"}
    if await held(harness) != set(IDS):
        ingested = await harness.client.post(
            "/v1/documents", json={"documents": DOCUMENTS}, headers=headers
        )
        assert ingested.status_code == 200, ingested.text
    before = await held(harness)
    response = await harness.client.post("/v1/documents/delete", json=body, headers=headers)
    assert response.status_code < 500, (body, response.text)
    after = await held(harness)
    if response.status_code != 200:
        assert response.status_code in (400, 413), (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert after == before, "a refused delete deleted something"
        return
    named = list(dict.fromkeys(body["ids"]))
    answer = response.json()
    assert after == before - set(named)
    assert answer["not_found"] == [i for i in named if i not in before]
    assert answer["documents"] == len(before & set(named)) == len(before) - len(after)
    assert answer["total_documents"] == len(after)
