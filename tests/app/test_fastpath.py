"""The cache-hit fast path (``app.http.fastpath``), against real Redis, the real embedding model
and the dev vLLM: the full path writes each entry (a real generation), the fast path answers the
same bytes as the full path; it lets everything unusual through to the full path; its aliases
never cross tenants, users, access scopes or index versions; hits still pay the rate limits;
hostile bodies never get a 500 or a wrong hit."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from app.http import fastpath
from app.http.fastpath import FAST_PATH_ATTRIBUTE, MAX_BODY_BYTES, PATH, files_digest
from app.http.shutdown import Shutdown
from app.main import create_app
from app.settings import Settings
from pipeline.answer.completion import Completion
from pipeline.stages.cache import MAX_COPIES, CacheLookup
from pipeline.store.keys import ApiKeyStore
from retrieval import Embedder
from tests.conftest import AppHarness, chat_request, make_settings, unique_question
from tests.support.servers import RedisServer, VLLMServer

VARYING = ("id", "created")  # what differs between any two answers, hits included


def plain(question: str | None = None, **extra: Any) -> bytes:
    """A plain chat request's exact bytes (no retrieval: the answer comes from the model)."""
    body = chat_request(question or unique_question(), max_tokens=4, rag={"enabled": False})
    return orjson.dumps({**body, **extra})


async def post(h: AppHarness, key: str | None, body: bytes, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return await h.client.post(PATH, content=body, headers=headers)


def served_fast(h: AppHarness, response: httpx.Response) -> bool:
    """Whether the fast path answered: the request's server span says so."""
    trace_id = int(response.headers["x-trace-id"], 16)
    roots = [
        s
        for s in h.exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER and s.context is not None and s.context.trace_id == trace_id
    ]
    assert len(roots) == 1, "every request has one server span"
    return bool((roots[0].attributes or {}).get(FAST_PATH_ATTRIBUTE))


async def warm(h: AppHarness, key: str, body: bytes) -> httpx.Response:
    """Ask once through the full path (a miss: a real generation), then again until the fast
    path answers (the next time, unless that answer was made with a stage degraded, a timeout
    on these loaded cores: such an answer is not stored, and the question is asked again)."""
    first = await post(h, key, body)
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss" and not served_fast(h, first)
    for _ in range(4):
        again = await post(h, key, body)
        assert again.status_code == 200, again.text
        if served_fast(h, again):
            assert again.headers["x-cache"] == "hit"
            return again
    raise AssertionError("the fast path never answered")


def without_varying(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in VARYING}


def same_headers(a: httpx.Response, b: httpx.Response, *moving: bytes) -> None:
    """Same names in the same order, same values but the trace id's and ``moving`` ones."""
    names = [name for name, _ in a.headers.raw]
    assert names == [name for name, _ in b.headers.raw]
    for (name, value), (_, other) in zip(a.headers.raw, b.headers.raw, strict=True):
        if name not in (b"x-trace-id", b"x-request-id", *moving):
            assert value == other, name


@pytest.fixture
def live_settings(redis_server: RedisServer, vllm: VLLMServer) -> Callable[..., Settings]:
    def build(**groups: dict[str, Any]) -> Settings:
        return make_settings(redis_server.url, vllm.url, **groups)

    return build


@pytest.fixture
async def h(make_app: Callable[..., Any], live_settings: Callable[..., Settings]) -> Any:
    async with make_app(live_settings()) as harness:
        yield harness


# --- the answer -----------------------------------------------------------------------------


async def test_a_fast_hit_is_the_full_paths_hit_byte_for_byte(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    # Two apps on one cache (one prefix): the fast path on, and off.
    on = live_settings()
    off = live_settings(cache={"fast_path": False}, redis={"key_prefix": on.redis.key_prefix})
    async with make_app(on) as fast, make_app(off) as full:
        key = await fast.key()
        body = plain()
        hit = await warm(fast, key, body)
        full_hit = await post(full, key, body)
        assert full_hit.headers["x-cache"] == "hit"
        same_headers(hit, full_hit)
        assert hit.content != full_hit.content, "each answer has its own id"
        answer, full_answer = hit.json(), full_hit.json()
        assert without_varying(answer) == without_varying(full_answer)
        assert answer["rag"]["cache"] == "hit"
        assert answer["id"].startswith("chatcmpl-") and len(answer["id"]) == len(full_answer["id"])
        assert len(orjson.dumps(answer)) == len(hit.content), "the same compact encoding"


async def test_a_fast_hit_has_the_rate_limit_headers_of_a_full_hit(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    on = live_settings(limits={"key_rpm": 100, "tenant_tpm": 100_000})
    off = live_settings(
        limits={"key_rpm": 100, "tenant_tpm": 100_000},
        cache={"fast_path": False},
        redis={"key_prefix": on.redis.key_prefix},
    )
    async with make_app(on) as fast, make_app(off) as full:
        key = await fast.key()
        body = plain()
        hit = await warm(fast, key, body)
        full_hit = await post(full, key, body)
        same_headers(
            hit,
            full_hit,
            b"x-ratelimit-remaining-requests",
            b"x-ratelimit-reset-requests",
            b"x-ratelimit-reset-tokens",
            b"x-ratelimit-remaining-tokens",  # the miss's tokens are charged in the background
        )
        assert hit.headers["x-ratelimit-limit-requests"] == "100"
        assert hit.headers["x-ratelimit-remaining-requests"] == str(100 - 2)
        assert full_hit.headers["x-ratelimit-remaining-requests"] == str(100 - 3)
        assert "x-ratelimit-remaining-tokens" in hit.headers


async def test_a_fast_hit_is_traced_logged_and_counted(
    h: AppHarness, caplog: pytest.LogCaptureFixture
) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    parent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rag.request"):
        hit = await post(h, key, body, traceparent=parent)
    assert served_fast(h, hit)
    caller_trace = parent.split("-")[1]
    assert hit.headers["x-trace-id"] != caller_trace, "a trace of its own"
    trace_id = int(hit.headers["x-trace-id"], 16)
    spans = [s for s in h.exporter.get_finished_spans() if s.context.trace_id == trace_id]
    root = next(s for s in spans if s.kind == SpanKind.SERVER)
    assert root.parent is None
    assert [format(link.context.trace_id, "032x") for link in root.links] == [caller_trace]
    # Under it, the one Redis GET of the alias, and no stage.
    assert [s.name for s in spans if s is not root] == ["redis GET"]
    attributes = root.attributes or {}
    assert root.name == f"POST {PATH}" and attributes["http.route"] == PATH
    assert attributes["rag.cache.status"] == "hit" and attributes["rag.tenant"] == "acme"
    line = next(r for r in caplog.records if r.name == "rag.request")
    fields = line.__dict__["rag"]
    assert (fields["route"], fields["status"], fields["cache"]) == (PATH, 200, "hit")
    assert list(fields["stages"]) == ["fast_path"]
    took = fields["stages"]["fast_path"]
    assert took > 0 and round(took, 3) == took, "in ms to the µs, as the full path's stages"
    scrape = (await h.client.get("/metrics")).text
    assert f'route="{PATH}",status="200"' in scrape.replace('method="POST",', "")
    assert 'rag_stage_duration_seconds_count{stage="fast_path",status="ok"}' in scrape
    assert 'rag_cache_lookups_total{outcome="hit"}' in scrape


# --- what goes through to the full path ---------------------------------------------------


async def test_requests_without_a_usable_key_go_to_the_full_path(h: AppHarness) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    for credential in (None, "rag-not-a-key-" + "x" * 40, "y" * 600):
        refused = await post(h, credential, body)
        assert refused.status_code == 401 and not served_fast(h, refused)
    no_chat = await h.key(scopes="retrieve")
    denied = await post(h, no_chat, body)
    assert denied.status_code == 403 and not served_fast(h, denied)
    basic = await h.client.post(PATH, content=body, headers={"authorization": f"Basic {key}"})
    assert basic.status_code == 401


async def test_a_key_not_cached_in_process_goes_to_the_full_path(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    async with make_app(live_settings(auth={"key_cache_seconds": 0})) as h:
        key = await h.key()
        body = plain()
        assert (await post(h, key, body)).headers["x-cache"] == "miss"
        for _ in range(2):
            hit = await post(h, key, body)
            assert hit.headers["x-cache"] == "hit" and not served_fast(h, hit)


async def test_unusual_requests_go_to_the_full_path(h: AppHarness) -> None:
    key = await h.key()
    question = unique_question()
    body = plain(question)
    await warm(h, key, body)
    # The same request, read the same by the full path (a hit there), but not plain.
    unusual: dict[str, tuple[bytes, dict[str, str]]] = {
        "too big": (body + b" " * MAX_BODY_BYTES, {}),
        "streamed": (plain(question, stream=True), {}),
        "explained": (
            orjson.dumps(
                chat_request(question, max_tokens=4, rag={"enabled": False, "explain": True})
            ),
            {},
        ),
        "cache-control": (body, {"cache-control": "max-age=0"}),
    }
    for name, (content, headers) in unusual.items():
        for _ in range(2):  # the second time too: the full path left no alias
            answer = await post(h, key, content, **headers)
            assert answer.status_code == 200, (name, answer.text)
            assert answer.headers["x-cache"] == "hit", name
            assert not served_fast(h, answer), name
    bypass = await post(h, key, body, **{"cache-control": "no-cache"})
    assert bypass.headers["x-cache"] == "miss" and not served_fast(h, bypass)
    for broken in (b"{not json", body[:-1], b"", b"\xff" * 40):
        refused = await post(h, key, broken)
        assert refused.status_code == 400 and not served_fast(h, refused), broken


async def test_a_declared_length_that_lies_goes_to_the_full_path(h: AppHarness) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)

    async def chunks() -> AsyncIterator[bytes]:
        yield body  # sent chunked: no Content-Length at all

    streamed = await h.client.post(
        PATH, content=chunks(), headers={"authorization": f"Bearer {key}"}
    )
    assert streamed.headers["x-cache"] == "hit" and not served_fast(h, streamed)


async def test_redis_trouble_sends_hits_to_the_full_path(
    make_app: Callable[..., Any], vllm: VLLMServer
) -> None:
    own = RedisServer()
    own.start()
    try:
        async with make_app(make_settings(own.url, vllm.url)) as h:
            key = await h.key()
            body = plain()
            await warm(h, key, body)
            own.stop()
            answer = await post(h, key, body)
            # The key is still known (stale) and the cache fails open: a generation.
            assert answer.status_code == 200 and answer.headers["x-cache"] == "miss"
            assert not served_fast(h, answer)
    finally:
        own.stop()


async def test_a_damaged_alias_goes_to_the_full_path(h: AppHarness) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    prefix = h.app.state.settings.redis.key_prefix
    aliases = await h.services.kv.client.keys(f"{prefix}cache-alias:acme:*")
    assert len(aliases) == 1
    for damaged in (b"not json", b"[1, 2]", b'{"content": "no finish reason"}'):
        await h.services.kv.client.set(aliases[0], damaged, ex=60)
        answer = await post(h, key, body)
        assert answer.headers["x-cache"] == "hit" and not served_fast(h, answer)


async def test_a_draining_server_refuses_before_the_fast_path(
    shared_embedder: Embedder, live_settings: Callable[..., Settings]
) -> None:
    shutdown = Shutdown()
    exporter = InMemorySpanExporter()
    app = create_app(
        live_settings(),
        span_processors=[SimpleSpanProcessor(exporter)],
        embedder=shared_embedder,
        shutdown=shutdown,
    )
    async with app.router.lifespan_context(app):
        h = AppHarness(app, exporter)
        key = await h.key()
        body = plain()
        await warm(h, key, body)
        shutdown.begin()
        refused = await post(h, key, body)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        await h.client.aclose()


# --- never across tenants, users, access scopes, index versions ------------------------------


async def test_another_tenant_with_the_same_bytes_is_a_miss(h: AppHarness) -> None:
    body = plain()
    await warm(h, await h.key("acme", "alice"), body)
    other = await post(h, await h.key("globex", "alice"), body)
    assert other.headers["x-cache"] == "miss" and not served_fast(h, other)


async def test_another_user_is_a_miss_where_answers_are_personalised(h: AppHarness) -> None:
    assert h.services.features is not None, "features on: answers are personalised"
    body = plain()
    await warm(h, await h.key("acme", "alice"), body)
    other = await post(h, await h.key("acme", "bob"), body)
    assert other.headers["x-cache"] == "miss" and not served_fast(h, other)


RESTRICTED = {
    "id": "memo",
    "title": "Project Nightingale",
    "text": "Project Nightingale: Acme buys Globex for 3 billion dollars in cash.",
    "access": {"groups": ["finance"]},
}
PUBLIC = {"id": "canteen", "title": "Canteen", "text": "The canteen serves lunch from noon."}


async def ingest(h: AppHarness, key: str, documents: list[dict[str, Any]]) -> None:
    response = await h.client.post(
        "/v1/documents", json={"documents": documents}, headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 200, response.text


@asynccontextmanager
async def shared_by_users(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> AsyncIterator[AppHarness]:
    """Features off: users of a tenant share entries unless their access differs."""
    async with make_app(live_settings(features={"enabled": False})) as h:
        yield h


def question_with_sources() -> bytes:
    body = chat_request(
        f"What does Acme buy? ({uuid.uuid4().hex[:6]})",
        max_tokens=4,
        rag={"top_k": 2, "min_relevance": 0},
    )
    return orjson.dumps(body)


async def test_users_with_another_access_scope_never_share_an_alias(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    async with shared_by_users(make_app, live_settings) as h:
        scopes = frozenset({"chat", "retrieve", "ingest"})
        ann = await h.services.keys.create("acme", "ann", scopes, groups=frozenset({"finance"}))
        bob = await h.services.keys.create("acme", "bob", scopes, groups=frozenset({"sales"}))
        cat = await h.services.keys.create("acme", "cat", scopes, groups=frozenset({"finance"}))
        await ingest(h, ann, [RESTRICTED, PUBLIC])
        body = question_with_sources()
        hit = await warm(h, ann, body)
        assert "memo" in {s["document_id"] for s in hit.json()["rag"]["sources"]}
        for_bob = await post(h, bob, body)
        assert for_bob.headers["x-cache"] == "miss" and not served_fast(h, for_bob)
        assert "memo" not in {s["document_id"] for s in for_bob.json()["rag"]["sources"]}
        # Same groups, same view of the index: the same entry, and the alias with it (once
        # this process knows cat's key).
        assert await h.client.get("/v1/models", headers={"authorization": f"Bearer {cat}"})
        for_cat = await post(h, cat, body)
        assert for_cat.headers["x-cache"] == "hit" and served_fast(h, for_cat)


async def test_an_ingest_between_two_requests_makes_the_second_a_miss(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    async with shared_by_users(make_app, live_settings) as h:
        key = await h.key(scopes="chat,retrieve,ingest")
        await ingest(h, key, [PUBLIC])
        body = question_with_sources()
        await warm(h, key, body)
        await ingest(h, key, [{**PUBLIC, "id": "garage", "text": "Acme parks on level two."}])
        after = await post(h, key, body)
        assert after.headers["x-cache"] == "miss" and not served_fast(h, after)


async def test_an_answer_refreshed_with_no_cache_replaces_what_the_fast_path_answers(
    h: AppHarness,
) -> None:
    # The alias is a copy of the entry: a `Cache-Control: no-cache` request stored a new answer
    # under the entry's key, and the fast path went on answering the old one, for its TTL.
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    lookup = next(s for s in h.paths.chat.steps if isinstance(s, CacheLookup))
    aliases = lookup.cache.prefix.rstrip(":") + "-alias:acme:*"
    assert await h.services.kv.client.keys(aliases), "the fast path's copy"
    for _ in range(4):  # a refresh made with a stage degraded (a loaded machine) is not stored
        refreshed = await post(h, key, body, **{"cache-control": "no-cache"})
        assert refreshed.status_code == 200 and not served_fast(h, refreshed)
        if not await h.services.kv.client.keys(aliases):
            break
    else:
        raise AssertionError("the refreshed answer left the copy of the one it replaced")
    after = await post(h, key, body)
    assert after.headers["x-cache"] == "hit" and not served_fast(h, after)
    assert answered(after) == answered(refreshed)
    again = await post(h, key, body)
    assert served_fast(h, again) and answered(again) == answered(refreshed)


async def test_an_entry_keeps_a_bounded_number_of_copies(h: AppHarness) -> None:
    cache = next(s for s in h.paths.chat.steps if isinstance(s, CacheLookup)).cache
    kv = h.services.kv
    completion = Completion(model="smollm2", content="Hi.", finish_reason="stop")
    await cache.put("acme:entry", completion)
    names = [f"{cache.prefix}copy:{n}" for n in range(MAX_COPIES)]
    for name in names:
        assert await cache.copy("acme:entry", name)
    assert await cache.copy("acme:entry", names[0]), "copied again, still one of the set"
    assert not await cache.copy("acme:entry", f"{cache.prefix}copy:one-too-many")
    assert not await cache.copy("acme:nothing", f"{cache.prefix}copy:of-nothing")
    assert await kv.client.exists(*names) == MAX_COPIES
    # The entry's TTL is read first: read second, a millisecond boundary passed between the
    # two reads made it the smaller (a run of this session failed so).
    entry_ttl = await kv.client.pttl(cache.prefix + "acme:entry")
    assert 0 < await kv.client.pttl(names[0]) <= entry_ttl
    await cache.put("acme:entry", completion)  # replaced: its copies go
    assert await kv.client.exists(*names) == 0
    assert await cache.get("acme:entry") == completion


async def test_aliases_written_by_other_code_are_not_found(
    make_app: Callable[..., Any],
    live_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A deploy that refuses more (a new input guard rule, a stricter schema) with the same
    # settings found the aliases the code before it wrote, and answered bodies it refuses.
    before = live_settings()
    async with make_app(before) as old:
        key = await old.key()
        body = plain()
        await warm(old, key, body)
    monkeypatch.setattr(fastpath, "code_digest", lambda: "the next release")
    async with make_app(before) as new:  # the same settings, the same Redis
        assert new.services.keys.subscribed, "served once the key-change channel is"
        known = await new.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert known.status_code == 200 and new.services.keys.cached(key) is not None
        first = await post(new, key, body)
        assert first.headers["x-cache"] == "hit" and not served_fast(new, first)
        assert served_fast(new, await post(new, key, body)), "its own alias"


def test_the_code_digest_follows_every_file_but_bytecode(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "data").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "rules.py").write_text("RULES = 1\n")
    (tmp_path / "pkg" / "data" / "exemplars.jsonl").write_text("{}\n")
    first = files_digest(tmp_path, ("pkg",))
    (tmp_path / "pkg" / "__pycache__" / "rules.cpython-311.pyc").write_bytes(b"\0")
    assert files_digest(tmp_path, ("pkg",)) == first
    (tmp_path / "pkg" / "data" / "exemplars.jsonl").write_text('{"new": 1}\n')
    second = files_digest(tmp_path, ("pkg",))
    assert second != first
    (tmp_path / "pkg" / "data" / "exemplars.jsonl").rename(tmp_path / "pkg" / "moved.jsonl")
    assert files_digest(tmp_path, ("pkg",)) not in (first, second), "a path counts"
    assert len(fastpath.code_digest()) == 64


async def test_a_key_revoked_elsewhere_is_refused_once_the_news_arrives(h: AppHarness) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    # Revoked by another process (`rag keys revoke`): its store announces it on the channel,
    # which this app listens to (waited for: a loaded machine may not have subscribed yet).
    for _ in range(1000):
        if h.services.keys.subscribed:
            break
        await asyncio.sleep(0.01)
    other = ApiKeyStore(h.services.kv, prefix=h.services.keys.prefix)
    assert await other.revoke(key) is not None
    for _ in range(1000):
        if h.services.keys.cached(key) is None:
            break
        await asyncio.sleep(0.01)
    assert h.services.keys.cached(key) is None, "the news of the revocation never arrived"
    refused = await post(h, key, body)
    assert refused.status_code == 401 and not served_fast(h, refused)


async def test_a_key_revoked_in_this_process_is_refused_at_once(h: AppHarness) -> None:
    key = await h.key()
    body = plain()
    await warm(h, key, body)
    await h.services.keys.revoke(key)
    refused = await post(h, key, body)
    assert refused.status_code == 401 and not served_fast(h, refused)


# --- rate limits ----------------------------------------------------------------------------


async def test_fast_hits_count_against_the_requests_per_minute(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    async with make_app(live_settings(limits={"key_rpm": 4, "window_seconds": 60})) as h:
        key = await h.key()
        body = plain()
        hit = await warm(h, key, body)  # two requests: a miss and a fast hit
        assert hit.headers["x-ratelimit-remaining-requests"] == "2"
        # A request the fast path admits and leaves to the full path (another body: a miss)
        # is admitted once, not again there.
        other = await post(h, key, plain())
        assert other.headers["x-cache"] == "miss" and not served_fast(h, other)
        assert other.headers["x-ratelimit-remaining-requests"] == "1"
        last = await post(h, key, body)
        assert served_fast(h, last) and last.headers["x-ratelimit-remaining-requests"] == "0"
        hits = cache_hits((await h.client.get("/metrics")).text)
        refused = await post(h, key, body)
        assert refused.status_code == 429 and served_fast(h, refused)
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        # Recorded as the full path records a 429: no cache lookup, no stage (it was counted
        # as a hit, and logged with cache "hit" and the fast path's stage).
        assert cache_hits((await h.client.get("/metrics")).text) == hits
        # Refused before its body is read, as on the full path (it waited for the whole body,
        # with no time limit, and with `Expect: 100-continue` invited it).
        sent: list[Any] = []
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": PATH,
            "raw_path": PATH.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"service"),
                (b"authorization", f"Bearer {key}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("service", 80),
        }
        never = asyncio.Event()

        async def no_body() -> Any:
            await never.wait()

        async def record(message: Any) -> None:
            sent.append(message)

        await asyncio.wait_for(h.app(scope, no_body, record), 10.0)
        assert sent[0]["status"] == 429
        # The full path refuses the same way (a key check, then the limits, then nothing).
        models = await h.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert models.status_code == 429
        assert models.json()["error"]["code"] == error["code"]


async def test_a_key_whose_token_window_is_spent_is_refused_a_hit_as_on_the_full_path(
    make_app: Callable[..., Any], live_settings: Callable[..., Settings]
) -> None:
    # The full path holds a request's estimated tokens before its cache lookup, refused while
    # the window is spent, hit or not. A review suspected the fast path answered such a hit:
    # it does not, since admission itself is refused while a token window is spent.
    async with make_app(live_settings()) as h:
        body = plain()
        roomy = await h.key()
        await warm(h, roomy, body)  # the answer and its alias, for the tenant
        raw = await h.services.keys.create("acme", "alice", frozenset({"chat"}), tpm=10)
        spender = await post(h, raw, plain())  # a miss: its tokens spend the key's window
        assert spender.status_code == 200 and spender.headers["x-cache"] == "miss"
        for _ in range(100):  # the tokens are charged once the answer is out
            probe = await h.client.get("/v1/models", headers={"authorization": f"Bearer {raw}"})
            if probe.headers.get("x-ratelimit-remaining-tokens") == "0":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the key's token window was never spent")
        refused = await post(h, raw, body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        # The same bytes from a key with room are a fast hit.
        assert served_fast(h, await post(h, roomy, body))


def cache_hits(scrape: str) -> float:
    """``rag_cache_lookups_total{outcome="hit"}`` in a scrape of /metrics (0 before any)."""
    for line in scrape.splitlines():
        if line.startswith('rag_cache_lookups_total{outcome="hit"}'):
            return float(line.split()[-1])
    return 0.0


# --- hostile bodies -------------------------------------------------------------------------


Answers = dict[bytes, Any]


@pytest.fixture
async def warmed(h: AppHarness) -> tuple[AppHarness, str, Answers]:
    """An app whose cache holds ``WARMED`` (a fast hit) for the key, and the answers the full
    path gave so far, by the bytes asked."""
    key = await h.key()
    hit = await warm(h, key, WARMED)
    return h, key, {WARMED: answered(hit)}


def answered(response: httpx.Response) -> Any:
    """What two answers to one question share, hit or miss."""
    answer = response.json()
    return (answer["model"], answer["choices"], answer["usage"])


def mutations(body: bytes) -> st.SearchStrategy[bytes]:
    """Bytes near the warmed body (one byte changed, cut, or grown) and bytes of any kind."""
    at = st.integers(0, len(body) - 1)
    return st.one_of(
        st.binary(max_size=300),
        st.tuples(at, st.integers(0, 255)).map(
            lambda p: body[: p[0]] + bytes([p[1]]) + body[p[0] + 1 :]
        ),
        at.map(lambda i: body[:i]),
        st.tuples(at, st.binary(min_size=1, max_size=8)).map(
            lambda p: body[: p[0]] + p[1] + body[p[0] :]
        ),
    )


WARMED = plain("In one short sentence, what is a hostile body? (fast path fuzz)")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(content=mutations(WARMED))
@example(content=WARMED + b"\n")
@example(content=WARMED.replace(b'"max_tokens":4', b'"max_tokens":5'))
async def test_hostile_bodies_never_get_a_500_or_a_wrong_hit(
    warmed: tuple[AppHarness, str, Answers], content: bytes
) -> None:
    h, key, answers = warmed
    # Hypothesis seeds `random` alike for every example, and trace ids come from it.
    h.exporter.clear()
    answer = await post(h, key, content)
    assert answer.status_code < 500, (content, answer.text)
    if served_fast(h, answer):
        # Only bytes the full path answered before, and with what it answered them.
        assert content in answers and answered(answer) == answers[content], content
    elif answer.status_code == 200:
        answers[content] = answered(answer)
