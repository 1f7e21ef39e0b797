"""A tenant routed to Milvus (Milvus Lite) through the HTTP API: ingest, search, filters,
delete and the index version, beside a tenant on the embedded index, in one app."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from retrieval.backends.versions import RedisVersions
from tests.app.test_errors import assert_openai_error
from tests.app.test_retrieval_api import DOCS, auth, ingest, search
from tests.conftest import chat_request, make_settings
from tests.pipeline.jobs.conftest import wait_until
from tests.support.servers import free_port


@pytest.fixture
async def harness(make_app, redis_server, tmp_path: Path):
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        retrieval={"tenant_backends": {"big": "milvus"}, "milvus_uri": str(tmp_path / "m.db")},
    )
    async with make_app(settings) as h:
        yield h


async def test_a_milvus_tenant_is_served_by_milvus_and_an_embedded_one_by_its_snapshots(
    harness,
) -> None:
    big = await harness.key(tenant="big", scopes="retrieve,ingest")
    small = await harness.key(tenant="small", scopes="retrieve,ingest")
    assert (await harness.client.get("/readyz")).json()["checks"]["milvus"] == "ok"
    search_service = harness.services.retrieval
    assert search_service.backend("big").name == "milvus"
    assert search_service.backend("small").name == "embedded"
    empty = await search(harness, big, "flightless bird")
    assert empty["data"] == [] and empty["index_version"] == "0"
    result = await ingest(harness, big, DOCS)
    assert result["documents"] == 3 and result["total_documents"] == 3
    await ingest(harness, small, DOCS[:1])
    found = await search(harness, big, "flightless bird from New Zealand", top_k=2)
    assert found["data"][0]["document_id"] == "kiwi-1"
    assert found["index_version"] == result["version"] != "0"
    assert search_service.backend("small").document_ids("small") == {"kiwi-1"}
    assert search_service.backend("big").document_ids("big") == {d["id"] for d in DOCS}
    food = await search(harness, big, "kiwi", top_k=10, filters={"topic": "food"})
    assert [hit["document_id"] for hit in food["data"]] == ["kiwi-fruit-3"]
    recent = await search(harness, big, "kiwi", top_k=10, filters={"year": {"$gte": 2021}})
    assert {hit["document_id"] for hit in recent["data"]} == {"kiwi-fruit-3"}

    deleted = await harness.client.delete("/v1/documents/fjord-2", headers=auth(big))
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    after = await search(harness, big, "fjord glacier inlet", top_k=10)
    assert "fjord-2" not in {hit["document_id"] for hit in after["data"]}
    assert after["index_version"] != found["index_version"]


@pytest.mark.parametrize(
    "filters",
    [
        {'year") or tenant == "small': {"$gte": 1}},
        {"year": {"$lt": "2020\x00"}},
        {"a.b": {"$gt": 1}},
    ],
)
async def test_a_filter_milvus_cannot_express_is_a_400_not_a_500(harness, filters) -> None:
    big = await harness.key(tenant="big", scopes="retrieve,ingest")
    await ingest(harness, big, DOCS[:1])
    response = await harness.client.post(
        "/v1/retrieve", json={"query": "kiwi", "filters": filters}, headers=auth(big)
    )
    assert_openai_error(response, 400, "invalid_request_error")


async def test_a_milvus_tenants_chat_is_grounded_in_its_passages_and_cached_per_index_version(
    make_app, redis_server, vllm, tmp_path: Path
) -> None:
    settings = make_settings(
        redis_server.url,
        vllm.url,
        retrieval={"tenant_backends": {"big": "milvus"}, "milvus_uri": str(tmp_path / "m.db")},
    )
    async with make_app(settings) as harness:
        key = await harness.key(tenant="big", scopes="chat,ingest")
        await ingest(harness, key, DOCS)
        body = chat_request("Which flightless bird lives in New Zealand?", max_tokens=8)
        first = await harness.chat(key, body)
        assert first.status_code == 200, first.text
        assert first.headers["x-cache"] == "miss"
        sources = [s["document_id"] for s in first.json()["rag"]["sources"]]
        assert sources and sources[0] == "kiwi-1", sources
        assert (await harness.chat(key, body)).headers["x-cache"] == "hit"
        # A write bumps the tenant's version in Redis: the cached answer is not served again.
        await ingest(harness, key, [{"id": "moa-4", "text": "The moa was a flightless bird."}])
        again = await harness.chat(key, body)
        assert again.status_code == 200 and again.headers["x-cache"] == "miss"
        assert {s["document_id"] for s in again.json()["rag"]["sources"]} & {"kiwi-1", "moa-4"}


async def test_a_milvus_that_stops_answering_is_a_503_for_its_tenant_only(
    make_app, redis_server, tmp_path: Path
) -> None:
    settings = _short_timeout_settings(redis_server.url, str(tmp_path / "m.db"))
    async with make_app(settings) as harness:
        await _milvus_stops(harness)


def _short_timeout_settings(redis_url: str, milvus_uri: str) -> Any:
    """Tenant "big" on Milvus at ``milvus_uri``; each Milvus call waits (and pymilvus retries)
    up to the timeout: a short one here. No model server."""
    return make_settings(
        redis_url,
        f"http://127.0.0.1:{free_port()}",
        retrieval={
            "tenant_backends": {"big": "milvus"},
            "milvus_uri": milvus_uri,
            "milvus_timeout_seconds": 1.0,
        },
    )


async def test_a_milvus_that_cannot_be_reached_at_the_start_holds_up_only_its_tenants(
    make_app, redis_server
) -> None:
    # Before, the app did not start: every tenant was down for one backend's.
    settings = _short_timeout_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    # The tenant was written to before Milvus went away: its searches go to Milvus.
    written = RedisVersions(redis_server.url, settings.redis.key_prefix, reload_interval_s=0.0)
    written.bump("big")
    written.close()
    async with make_app(settings) as harness:
        big = await harness.key(tenant="big", scopes="retrieve,ingest")
        small = await harness.key(tenant="small", scopes="retrieve,ingest")
        await ingest(harness, small, DOCS[:1])
        assert (await search(harness, small, "kiwi"))["data"][0]["document_id"] == "kiwi-1"
        ready = (await harness.client.get("/readyz")).json()
        assert ready["checks"]["milvus"] == "down" and ready["checks"]["redis"] == "ok"
        for response in (
            await harness.client.post("/v1/retrieve", json={"query": "kiwi"}, headers=auth(big)),
            await harness.client.post(
                "/v1/documents", json={"documents": DOCS[1:2]}, headers=auth(big)
            ),
        ):
            error = assert_openai_error(response, 503, "service_unavailable")
            assert error["code"] == "retrieval_unavailable", error
            assert "milvus retrieval backend cannot be reached" in error["message"]
            assert "127.0.0.1" not in error["message"]
        # A chat tries Milvus again, in a thread of its own: neither the event loop nor the
        # search and ingest threads, which every tenant shares, wait for the connection.
        milvus = harness.services.retrieval.backend("big")
        milvus.retry_s = 0.0
        build, threads = milvus._build, []

        def recorded() -> Any:
            threads.append(threading.current_thread().name)
            return build()

        milvus._build = recorded
        chat = await harness.key(tenant="big")
        response = await harness.chat(chat, chat_request("What is a kiwi?"))
        assert_openai_error(response, 503, "service_unavailable")

        async def tried() -> bool:
            return bool(threads)

        await wait_until(tried, within=10.0, what="the connection to be tried again")
        assert set(threads) == {"milvus-connect"}, threads


async def _milvus_stops(harness) -> None:
    big = await harness.key(tenant="big", scopes="retrieve,ingest")
    small = await harness.key(tenant="small", scopes="retrieve,ingest")
    await ingest(harness, big, DOCS[:1])
    await ingest(harness, small, DOCS[:1])
    from milvus_lite.server_manager import server_manager_instance

    milvus = harness.services.retrieval.backend("big").get()  # built at the app's start
    server_manager_instance.release_server(milvus.client._lite_path)  # Milvus Lite stops
    refused = await harness.client.post("/v1/retrieve", json={"query": "kiwi"}, headers=auth(big))
    error = assert_openai_error(refused, 503, "service_unavailable")
    assert error["code"] == "retrieval_unavailable" and "Milvus" in error["message"]
    written = await harness.client.post(
        "/v1/documents", json={"documents": DOCS[1:2]}, headers=auth(big)
    )
    assert_openai_error(written, 503, "service_unavailable")
    assert (await search(harness, small, "kiwi"))["data"][0]["document_id"] == "kiwi-1"
    assert (await harness.client.get("/readyz")).json()["checks"]["milvus"] == "down"


async def test_writes_during_a_move_are_a_503_with_retry_after_and_searches_go_on(
    harness,
) -> None:
    big = await harness.key(tenant="big", scopes="retrieve,ingest")
    small = await harness.key(tenant="small", scopes="retrieve,ingest")
    await ingest(harness, big, DOCS[:2])
    fence = harness.services.retrieval.backends.fence
    token = fence.begin("big")  # as `rag backend move` does, from any process
    try:
        for response in (
            await harness.client.post(
                "/v1/documents", json={"documents": DOCS[2:]}, headers=auth(big)
            ),
            await harness.client.delete("/v1/documents/kiwi-1", headers=auth(big)),
        ):
            error = assert_openai_error(response, 503, "service_unavailable")
            assert error["code"] == "index_moving"
            assert response.headers["retry-after"] == "5"
        found = await search(harness, big, "flightless bird from New Zealand", top_k=5)
        assert found["data"][0]["document_id"] == "kiwi-1"
        await ingest(harness, small, DOCS[:1])  # another tenant writes on
    finally:
        fence.end("big", token)
    assert (await ingest(harness, big, DOCS[2:]))["total_documents"] == 3
    assert fence.writes_in_flight("big") == 0  # every write left its registration
