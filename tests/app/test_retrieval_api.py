"""Ingest, search and chat with retrieval through the HTTP API, per tenant."""

from __future__ import annotations

import asyncio
import fcntl
import time
import uuid

import pytest

from app.path import response_cache
from pipeline.answer.completion import Completion
from tests.app.test_errors import assert_openai_error
from tests.conftest import make_settings
from tests.pipeline.test_singleflight import settled
from tests.support.faultproxy import FaultProxy
from tests.support.servers import free_port

DOCS = [
    {
        "id": "kiwi-1",
        "title": "Kiwi birds",
        "text": "The kiwi is a flightless bird endemic to New Zealand. It lays a very large egg.",
        "metadata": {"topic": "birds", "year": 2020, "tags": ["nz", "fauna"]},
    },
    {
        "id": "fjord-2",
        "title": "Fjords",
        "text": "A fjord is a long, narrow inlet with steep sides, created by a glacier.",
        "metadata": {"topic": "geology", "year": 2015, "tags": ["norway"]},
    },
    {
        "id": "kiwi-fruit-3",
        "title": "Kiwifruit",
        "text": "Kiwifruit is the edible berry of a woody vine; New Zealand exports kiwifruit.",
        "metadata": {"topic": "food", "year": 2022, "tags": ["nz"]},
    },
]


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    async with make_app(settings) as h:
        yield h


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def ingest(harness, key: str, documents: list[dict]) -> dict:
    response = await harness.client.post(
        "/v1/documents", json={"documents": documents}, headers=auth(key)
    )
    assert response.status_code == 200, response.text
    return response.json()


async def search(harness, key: str, query: str, **extra) -> dict:
    response = await harness.client.post(
        "/v1/retrieve", json={"query": query, **extra}, headers=auth(key)
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_ingest_needs_the_ingest_scope(harness) -> None:
    key = await harness.key(scopes="chat,retrieve")
    response = await harness.client.post(
        "/v1/documents", json={"documents": DOCS}, headers=auth(key)
    )
    assert_openai_error(response, 403, "permission_error")


async def test_ingested_documents_are_searchable_by_the_next_request(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    before = await search(harness, key, "flightless bird")
    assert before["data"] == []
    result = await ingest(harness, key, DOCS)
    assert result["documents"] == 3 and result["total_documents"] == 3
    found = await search(harness, key, "flightless bird from New Zealand", top_k=2)
    assert found["data"][0]["document_id"] == "kiwi-1"
    assert found["index_version"] == result["version"] != before["index_version"]
    hit = found["data"][0]
    assert hit["title"] == "Kiwi birds" and "flightless" in hit["text"]
    assert hit["metadata"]["topic"] == "birds"
    assert hit["chunk_id"].startswith("kiwi-1")


async def test_another_tenant_never_sees_the_documents(harness) -> None:
    owner = await harness.key(tenant="owner", scopes="retrieve,ingest")
    stranger = await harness.key(tenant="stranger", scopes="retrieve,ingest")
    await ingest(harness, owner, DOCS)
    await ingest(
        harness, stranger, [{"id": "other", "text": "Glaciers carve valleys over millennia."}]
    )
    seen = await search(harness, stranger, "kiwi flightless bird New Zealand", top_k=10)
    assert {h["document_id"] for h in seen["data"]} <= {"other"}
    mine = await search(harness, owner, "glaciers carve valleys", top_k=10)
    assert "other" not in {h["document_id"] for h in mine["data"]}


async def test_filters_narrow_the_results_and_unknown_keys_give_nothing(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    await ingest(harness, key, DOCS)
    query = "New Zealand kiwi"
    everything = {h["document_id"] for h in (await search(harness, key, query, top_k=10))["data"]}
    assert {"kiwi-1", "kiwi-fruit-3"} <= everything
    food = await search(harness, key, query, top_k=10, filters={"topic": "food"})
    assert [h["document_id"] for h in food["data"]] == ["kiwi-fruit-3"]
    recent = await search(harness, key, query, top_k=10, filters={"year": {"$gte": 2021}})
    assert [h["document_id"] for h in recent["data"]] == ["kiwi-fruit-3"]
    either = await search(
        harness, key, query, top_k=10, filters={"topic": {"$in": ["birds", "geology"]}}
    )
    assert {h["document_id"] for h in either["data"]} <= {"kiwi-1", "fjord-2"}
    assert "kiwi-1" in {h["document_id"] for h in either["data"]}
    nz_birds = await search(harness, key, query, top_k=10, filters={"tags": "nz", "topic": "birds"})
    assert [h["document_id"] for h in nz_birds["data"]] == ["kiwi-1"]
    unknown = await search(harness, key, query, top_k=10, filters={"colour": "green"})
    assert unknown["data"] == []


async def test_invalid_filter_syntax_is_400(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    response = await harness.client.post(
        "/v1/retrieve",
        json={"query": "kiwi", "filters": {"year": {"$between": [1, 2]}}},
        headers=auth(key),
    )
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert "$between" in error["message"]


async def test_reingest_replaces_and_delete_removes(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    await ingest(harness, key, DOCS)
    replaced = {**DOCS[1], "text": "A fjord was renamed: now it describes volcanic calderas."}
    await ingest(harness, key, [replaced])
    hits = (await search(harness, key, "volcanic calderas", top_k=3))["data"]
    assert hits[0]["document_id"] == "fjord-2" and "calderas" in hits[0]["text"]
    assert len([h for h in hits if h["document_id"] == "fjord-2"]) == 1
    deleted = await harness.client.delete("/v1/documents/fjord-2", headers=auth(key))
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    hits = (await search(harness, key, "volcanic calderas fjord", top_k=5))["data"]
    assert "fjord-2" not in {h["document_id"] for h in hits}
    # Ids from `rag ingest FOLDER` are relative paths; they can be deleted by URL too.
    await ingest(harness, key, [{"id": "notes/a.md", "text": "Sourdough needs a starter."}])
    by_path = await harness.client.delete("/v1/documents/notes/a.md", headers=auth(key))
    assert by_path.status_code == 200 and by_path.json()["deleted"] is True
    missing = await harness.client.delete("/v1/documents/never-there", headers=auth(key))
    assert assert_openai_error(missing, 404, "invalid_request_error")["code"] == (
        "document_not_found"
    )


def held(harness, tenant: str) -> set[str]:
    """The ids of the tenant's documents, as its index holds them."""
    return harness.services.retrieval.backend(tenant).document_ids(tenant)


async def test_many_documents_are_deleted_as_one_version_and_the_ids_not_there_are_named(
    harness,
) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    other = await harness.key(tenant="globex", scopes="retrieve,ingest")
    for each in (key, other):
        await ingest(harness, each, DOCS)
    before = (await search(harness, key, "kiwi"))["index_version"]
    cache = response_cache(harness.services.settings, harness.services.kv)
    answer = Completion(model="smollm2", content="The kiwi.", finish_reason="stop")
    for tenant in ("acme", "globex"):
        assert await cache.put(f"{tenant}:{'1' * 64}", answer, version=before)

    ids = ["kiwi-1", "nope", "fjord-2", "kiwi-1"]
    deleted = await harness.client.post(
        "/v1/documents/delete", json={"ids": ids}, headers=auth(key)
    )
    assert deleted.status_code == 200, deleted.text
    body = deleted.json()
    assert body["object"] == "delete.result"
    assert (body["documents"], body["not_found"], body["total_documents"]) == (2, ["nope"], 1)
    assert body["cached_answers_removed"] == 1  # this tenant's answer, not globex's
    # One new version for the two documents (a DELETE each would have published two).
    assert int(body["version"][:8]) == int(before[:8]) + 1
    assert held(harness, "acme") == {"kiwi-fruit-3"}
    assert held(harness, "globex") == {"kiwi-1", "fjord-2", "kiwi-fruit-3"}
    assert await cache.get(f"globex:{'1' * 64}") == answer

    # None of them there: nothing changes, and nothing is erased.
    none = await harness.client.post(
        "/v1/documents/delete", json={"ids": ["kiwi-1", "never"]}, headers=auth(key)
    )
    assert none.status_code == 200, none.text
    assert none.json()["not_found"] == ["kiwi-1", "never"]
    assert (none.json()["documents"], none.json()["version"]) == (0, body["version"])
    assert none.json()["cached_answers_removed"] == 0


async def test_a_delete_of_many_refuses_what_it_cannot_take_and_deletes_nothing(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    await ingest(harness, key, DOCS)
    limit = harness.services.settings.retrieval.max_batch_documents
    refused: list[tuple[object, int, str | None]] = [
        ({"ids": []}, 400, "ids"),
        ({"ids": "kiwi-1"}, 400, "ids"),
        ({"ids": ["kiwi-1", "a b"]}, 400, "ids.1"),
        ({"ids": ["kiwi-1#0"]}, 400, "ids.0"),
        ({"ids": ["x" * 257]}, 400, "ids.0"),
        ({"ids": [1]}, 400, "ids.0"),
        ({"ids": None}, 400, "ids"),
        ({}, 400, "ids"),
        ({"ids": ["kiwi-1"], "filter": {"topic": "birds"}}, 400, "filter"),
        ([{"ids": ["kiwi-1"]}], 400, None),
        ({"ids": [f"d{n}" for n in range(limit + 1)]}, 413, "ids"),
    ]
    for body, status, param in refused:
        response = await harness.client.post("/v1/documents/delete", json=body, headers=auth(key))
        error = assert_openai_error(response, status, "invalid_request_error")
        assert param is None or error["param"] == param, (body, error)
    for raw in (b"", b"not json", b'{"ids": ["kiwi-1"]', b'{"ids": ["kiwi-1"], "ids": []}'):
        response = await harness.client.post(
            "/v1/documents/delete",
            content=raw,
            headers={**auth(key), "content-type": "application/json"},
        )
        assert 400 <= response.status_code < 500, (raw, response.text)
    reader = await harness.key(scopes="chat,retrieve")
    forbidden = await harness.client.post(
        "/v1/documents/delete", json={"ids": ["kiwi-1"]}, headers=auth(reader)
    )
    assert_openai_error(forbidden, 403, "permission_error")
    assert held(harness, "acme") == {"kiwi-1", "fjord-2", "kiwi-fruit-3"}


async def test_bad_documents_are_refused_with_4xx(make_app, redis_server) -> None:
    settings = make_settings(
        redis_server.url, "http://127.0.0.1:9", retrieval={"max_document_chars": 8000}
    )
    async with make_app(settings) as harness:
        key = await harness.key(scopes="retrieve,ingest")
        empty = await harness.client.post(
            "/v1/documents", json={"documents": [{"id": "e", "text": "   "}]}, headers=auth(key)
        )
        error = assert_openai_error(empty, 400, "invalid_request_error")
        assert error["param"] == "documents.0.text"
        long_text = " ".join(f"word{i}" for i in range(700))  # ~5 chunks, under the limit
        chunked = await ingest(harness, key, [{"id": "long", "text": long_text}])
        assert chunked["chunks"] > 1
        huge = await harness.client.post(
            "/v1/documents",
            json={"documents": [{"id": "huge", "text": "x " * 6000}]},
            headers=auth(key),
        )
        assert_openai_error(huge, 413, "invalid_request_error")
        bad_metadata = await harness.client.post(
            "/v1/documents",
            json={"documents": [{"id": "m", "text": "t", "metadata": {"k": {"nested": 1}}}]},
            headers=auth(key),
        )
        assert_openai_error(bad_metadata, 400, "invalid_request_error")
        # One id twice: the batch is applied in order, so its last copy is kept (as documented).
        twice = await ingest(
            harness, key, [{"id": "d", "text": "first copy"}, {"id": "d", "text": "second copy"}]
        )
        assert twice["documents"] == 1
        kept = await search(harness, key, "second copy", top_k=5, min_relevance=0)
        assert [(h["document_id"], h["text"]) for h in kept["data"] if h["document_id"] == "d"] == [
            ("d", "second copy")
        ]
        invisible = await harness.client.post(
            "/v1/documents",
            json={"documents": [{"id": "z", "text": "\u200b\u0001\ufeff"}]},
            headers=auth(key),
        )
        assert assert_openai_error(invisible, 400, "invalid_request_error")["param"] == (
            "documents.0.text"
        )
        # The filler words are no topic: the relevance gate is set aside to find them.
        still = await search(harness, key, "word5", top_k=1, min_relevance=0)
        assert still["data"][0]["document_id"] == "long", "nothing stored was lost"


async def test_chat_retrieves_cites_sources_and_ingest_changes_the_cache_key(
    make_app, redis_server, vllm
) -> None:
    async with make_app(make_settings(redis_server.url, vllm.url)) as harness:
        key = await harness.key(scopes="chat,retrieve,ingest")
        await ingest(harness, key, DOCS)
        request = {
            "model": "smollm2",
            "messages": [
                {"role": "user", "content": f"Which bird is flightless? ({uuid.uuid4().hex[:6]})"}
            ],
            "max_tokens": 12,
            "temperature": 0,
            "rag": {"top_k": 2, "explain": True},
        }
        harness.exporter.clear()
        first = await harness.chat(key, request)
        assert first.status_code == 200, first.text
        sources = first.json()["rag"]["sources"]
        # top_k 2, but the relevance gate lets only the passage about the bird through.
        assert [s["document_id"] for s in sources] == ["kiwi-1"]
        stages = [s["name"] for s in first.json()["rag"]["explain"]["stages"]]
        assert sorted(stages) == sorted(harness.paths.chat.stage_names)
        # The less relevant of the two passages is still above the gate's threshold.
        retrieve = next(
            s for s in first.json()["rag"]["explain"]["stages"] if s["name"] == "retrieve"
        )
        assert retrieve["info"]["retrieval.no_sources"] is False
        spans = {s.name: s for s in harness.exporter.get_finished_spans()}
        retrieval_span = spans["retrieval acme"]
        assert retrieval_span.parent.span_id == spans["stage retrieve"].context.span_id
        assert retrieval_span.attributes["rag.retrieval.candidates"] >= 2
        for step in ("filter", "bm25", "vector", "fusion", "embed"):
            assert retrieval_span.attributes[f"rag.retrieval.ms.{step}"] >= 0

        assert (await harness.chat(key, request)).headers["x-cache"] == "hit"
        await ingest(harness, key, [{"id": "new-doc", "text": "Penguins cannot fly either."}])
        after = await harness.chat(key, request)
        assert after.headers["x-cache"] == "miss", "an ingest must invalidate cached answers"


def flightless(top_k: int = 2) -> dict:
    """A question the kiwi document answers, asked for the first time."""
    return {
        "model": "smollm2",
        "messages": [
            {"role": "user", "content": f"Which bird is flightless? ({uuid.uuid4().hex[:6]})"}
        ],
        "max_tokens": 12,
        "temperature": 0,
        "rag": {"top_k": top_k},
    }


async def cached_names(harness, tenant: str) -> list[bytes]:
    """The names of the tenant's cached answers, their copies' sets and fast-path copies."""
    prefix = harness.services.settings.redis.key_prefix
    kv = harness.services.kv
    return await kv.scan(f"{prefix}cache:{tenant}:*") + await kv.scan(
        f"{prefix}cache-alias:{tenant}:*"
    )


async def test_a_delete_erases_the_tenants_cached_answers_and_no_other_tenants(
    make_app, redis_server, vllm
) -> None:
    prefix = f"erase{uuid.uuid4().hex[:6]}:"
    settings = make_settings(redis_server.url, vllm.url, redis={"key_prefix": prefix})
    async with make_app(settings) as harness:
        key = await harness.key(scopes="chat,retrieve,ingest")
        other = await harness.key(tenant="globex", scopes="chat,retrieve,ingest")
        request = flightless()
        for each in (key, other):
            await ingest(harness, each, DOCS)
            first = await harness.chat(each, request)
            assert first.status_code == 200, first.text
            assert [s["document_id"] for s in first.json()["rag"]["sources"]] == ["kiwi-1"]
        for _ in range(2):  # a hit, then one served from its fast-path copy
            assert (await harness.chat(key, request)).headers["x-cache"] == "hit"
        stored = await cached_names(harness, "acme")
        assert any(b"cache-alias:" in n for n in stored), "the copy the test means to erase"
        theirs = set(await cached_names(harness, "globex"))
        answers = [n for n in stored if not n.endswith(b":copies")]
        quoting = [n for n in answers if b"kiwi-1" in (await harness.services.kv.get(n) or b"")]
        assert quoting, "a cached answer names the document"

        deleted = await harness.client.delete("/v1/documents/kiwi-1", headers=auth(key))
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["cached_answers_removed"] == 1
        assert await cached_names(harness, "acme") == []
        assert set(await cached_names(harness, "globex")) == theirs, "another tenant's stay"
        assert (await harness.chat(other, request)).headers["x-cache"] == "hit"
        after = await harness.chat(key, request)
        assert after.headers["x-cache"] == "miss"
        assert "kiwi-1" not in {s["document_id"] for s in after.json()["rag"]["sources"]}


async def test_an_answer_that_searched_before_a_delete_and_ends_after_it_is_not_cached(
    make_app, redis_server, vllm
) -> None:
    prefix = f"late{uuid.uuid4().hex[:6]}:"
    with FaultProxy(vllm.url) as llm:
        settings = make_settings(redis_server.url, llm.url, redis={"key_prefix": prefix})
        async with make_app(settings) as harness:
            key = await harness.key(scopes="chat,ingest")
            await ingest(harness, key, DOCS)
            # The answer is stored before its response ends (so the check at the end is
            # not early).
            plain = await harness.chat(key, flightless())
            assert plain.headers["x-cache"] == "miss" and await cached_names(harness, "acme")
            harness.exporter.clear()

            def retrieved() -> bool:
                return any(
                    s.name == "stage retrieve" for s in harness.exporter.get_finished_spans()
                )

            llm.pause()  # the answer's generation waits while the delete runs
            try:
                asking = asyncio.create_task(harness.chat(key, flightless()))
                await settled(lambda: retrieved() and llm.held > 0, seconds=60)
                deleted = await harness.client.delete("/v1/documents/kiwi-1", headers=auth(key))
                assert deleted.status_code == 200, deleted.text
            finally:
                llm.passing()
            late = await asking
            assert late.status_code == 200, late.text
            assert [s["document_id"] for s in late.json()["rag"]["sources"]] == ["kiwi-1"]
            assert late.headers["x-cache"] == "miss"
            assert await cached_names(harness, "acme") == [], "it quotes a deleted document"


async def test_searches_keep_answering_while_an_ingest_publishes_a_new_version(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    first = await ingest(harness, key, DOCS)
    more = [
        {"id": f"extra-{i}", "text": f"Filler passage number {i} about rivers."} for i in range(40)
    ]

    async def searches() -> list[dict]:
        results = []
        for _ in range(30):
            results.append(await search(harness, key, "flightless bird New Zealand", top_k=1))
            await asyncio.sleep(0)
        return results

    results, second = await asyncio.gather(searches(), ingest(harness, key, more))
    assert all(r["data"][0]["document_id"] == "kiwi-1" for r in results)
    assert {r["index_version"] for r in results} <= {first["version"], second["version"]}
    assert (await search(harness, key, "rivers", top_k=1))["index_version"] == second["version"]


async def test_a_write_waits_for_a_stalled_writer_only_so_long_then_is_refused_unwritten(
    make_app, redis_server
) -> None:
    # Another writer of the tenant (another replica, `rag ingest`) that stalls while it holds
    # the tenant's write lock: a stopped process, a hung disk. A write here used to wait for
    # it with no limit, each in turn holding this replica's one ingest thread, so every
    # tenant's writes waited behind them.
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        retrieval={"write_lock_wait_seconds": 0.5},
    )
    async with make_app(settings) as harness:
        key = await harness.key(scopes="retrieve,ingest")
        other = await harness.key(tenant="other", scopes="retrieve,ingest")
        first = await ingest(harness, key, DOCS)
        lock = settings.retrieval.index_dir / "acme" / ".lock"
        new = {"documents": [{"id": "new-1", "text": "Glaciers carve fjords."}]}
        with lock.open("a") as stalled:
            fcntl.flock(stalled, fcntl.LOCK_EX)  # held, and never touched: no progress
            started = time.monotonic()
            *refused, theirs = await asyncio.gather(
                *(
                    harness.client.post("/v1/documents", json=new, headers=auth(key))
                    for _ in range(3)
                ),
                harness.client.delete("/v1/documents/kiwi-1", headers=auth(key)),
                ingest(harness, other, DOCS[:1]),
            )
            waited = time.monotonic() - started
            messages = []
            for response in refused:
                error = assert_openai_error(response, 503, "service_unavailable")
                assert error["code"] == "index_busy", error
                assert int(response.headers["retry-after"]) >= 1
                messages.append(error["message"])
            # One write waited its half second in the ingest pool; the others were refused at
            # once, without taking the pool from another tenant's write, which went in.
            assert sum("for 0.5 s without progress" in m for m in messages) == 1, messages
            assert sum("a moment ago" in m for m in messages) == 3, messages
            assert theirs["documents"] == 1
            assert waited >= 0.5
            # Reads go on from the published version.
            found = await search(harness, key, "flightless bird", top_k=1)
            assert found["index_version"] == first["version"]
            assert found["data"][0]["document_id"] == "kiwi-1"
            fcntl.flock(stalled, fcntl.LOCK_UN)
        # Nothing of the refused writes was applied; once the Retry-After has passed, the same
        # write goes in.
        assert (await search(harness, key, "glaciers fjords", top_k=3))["index_version"] == (
            first["version"]
        )
        await asyncio.sleep(int(refused[0].headers["retry-after"]))
        again = await ingest(harness, key, new["documents"])
        assert again["total_documents"] == 4 and again["version"] != first["version"]


async def test_a_write_the_disk_has_no_room_for_is_a_507_and_the_index_serves_on(
    harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A probe on a full tmpfs: a 500 with a traceback (the catch-all), and the connection
    # dropped. The disk's refusal is simulated here (test_store.py has why).
    import errno

    import retrieval.store as store_module

    key = await harness.key(scopes="retrieve,ingest")
    first = await ingest(harness, key, DOCS)

    def full(index: object, directory: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_snapshot", full)
    new = {"documents": [{"id": "new-1", "text": "Glaciers carve fjords."}]}
    for response in (
        await harness.client.post("/v1/documents", json=new, headers=auth(key)),
        await harness.client.delete("/v1/documents/kiwi-1", headers=auth(key)),
    ):
        error = assert_openai_error(response, 507, "service_unavailable")
        assert error["code"] == "index_storage_full" and "no room" in error["message"], error
    monkeypatch.undo()
    found = await search(harness, key, "flightless bird", top_k=1)
    assert found["index_version"] == first["version"]
    assert found["data"][0]["document_id"] == "kiwi-1"
    assert (await ingest(harness, key, new["documents"]))["documents"] == 1
