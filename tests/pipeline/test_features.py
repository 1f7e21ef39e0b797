"""The feature store against a real Redis: typed reads, defaults, atomic writes, the real-time
counter, the request log, and the features stage degrading on a slow or absent Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider

from pipeline.context import ChatParams, Principal, RagOptions, RequestContext
from pipeline.features.language import guess_language
from pipeline.features.loader import LoadReport, parse_row, read_rows, write_rows
from pipeline.features.requestlog import derive_rows, equality_filters, request_record
from pipeline.features.spec import SPECS, FeatureValueError, parse_value
from pipeline.features.store import WINDOW_S, FeatureRow, FeatureStore
from pipeline.runner import INPUTS, Runner
from pipeline.stages.features import LoadFeatures
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry import attributes as attr
from tests.support.backlog import backlog
from tests.support.faultproxy import FaultProxy
from tests.support.servers import RedisServer

BATCH = sorted(name for name, spec in SPECS.items() if spec.source == "batch")


@pytest.fixture
async def store(redis_server, tracing) -> AsyncIterator[FeatureStore]:
    kv = KeyValueStore.from_url(redis_server.url, tracing[0].get_tracer("test"))
    yield FeatureStore(kv, prefix=f"f{uuid.uuid4().hex[:8]}:")
    await kv.aclose()


def context(user: str = "alice", text: str = "What is the capital of France?") -> RequestContext:
    return RequestContext(
        params=ChatParams(model="m", messages=[{"role": "user", "content": text}]),
        credential=None,
        deadline=asyncio.get_running_loop().time() + 10,
        principal=Principal("acme", user, frozenset({"chat"}), "k1"),
    )


async def run_stage(stage: LoadFeatures, tracing, ctx: RequestContext) -> RequestContext:
    runner = Runner([stage], tracing[0].get_tracer("test"), inputs=INPUTS | {"principal"})
    return await runner.run(ctx)


# --- the store ---


async def test_a_user_without_features_gets_every_default_and_they_are_named(store) -> None:
    lookup = await store.load("acme", "nobody")
    assert lookup.status == "miss"
    assert lookup.features.defaulted == frozenset(BATCH)
    assert lookup.features.values["tier"] == "free"
    assert lookup.features.values["department"] is None
    assert lookup.features.values["requests_last_hour"] == 1  # real-time: this request


async def test_loaded_features_come_back_typed_and_only_missing_ones_default(store) -> None:
    row = FeatureRow("acme", "alice", {"language": "pt", "tier": "pro", "request_count": 41})
    assert await store.write_many([row]) == 1
    lookup = await store.load("acme", "alice")
    assert lookup.status == "hit"
    values = lookup.features.values
    assert (values["language"], values["tier"], values["request_count"]) == ("pt", "pro", 41)
    assert lookup.features.defaulted == {"department", "top_filter"}
    assert lookup.features.version == "1"
    assert lookup.age_s is not None and 0 <= lookup.age_s < 60


async def test_a_reload_replaces_the_old_fields(store) -> None:
    await store.write_many([FeatureRow("acme", "alice", {"department": "sales", "tier": "pro"})])
    await store.write_many([FeatureRow("acme", "alice", {"language": "de"})])
    lookup = await store.load("acme", "alice")
    assert lookup.features.values["language"] == "de"
    assert {"department", "tier"} <= lookup.features.defaulted
    assert lookup.features.values["tier"] == "free"


async def test_readers_never_see_a_half_written_user(store) -> None:
    # Replacing is DEL + HSET; sent as two round trips, a reader slips in between and sees an
    # empty hash (it does, within 100 replacements, when tried). Replacements race reads here.
    first = FeatureRow("acme", "alice", {"department": "sales", "language": "en"})
    second = FeatureRow("acme", "alice", {"tier": "pro", "request_count": 3})
    await store.write_many([first])
    key = store.key("acme", "alice")
    seen: set[frozenset[bytes]] = set()
    writing = True

    async def writer() -> None:
        nonlocal writing
        for index in range(100):
            await store.write_many([second if index % 2 else first])
        writing = False

    async def reader() -> None:
        while writing:
            fields = await store.kv.hgetall(key)
            seen.add(frozenset(fields) - {b"_version", b"_updated"})

    await asyncio.gather(writer(), reader(), reader())
    assert seen <= {
        frozenset({b"department", b"language"}),
        frozenset({b"tier", b"request_count"}),
    }, seen
    assert len(seen) == 2


async def test_a_merge_keeps_other_fields_unless_the_hash_is_of_another_version(store) -> None:
    await store.write_many([FeatureRow("acme", "alice", {"department": "sales"})])
    await store.write_many([FeatureRow("acme", "alice", {"request_count": 7})], merge=True)
    values = (await store.load("acme", "alice")).features.values
    assert (values["department"], values["request_count"]) == ("sales", 7)

    await store.kv.hset(store.key("acme", "alice"), {"_version": "0"})
    await store.write_many([FeatureRow("acme", "alice", {"request_count": 8})], merge=True)
    lookup = await store.load("acme", "alice")
    assert lookup.features.values["request_count"] == 8
    assert "department" in lookup.features.defaulted


async def test_a_hash_of_another_feature_set_version_is_ignored(store) -> None:
    await store.kv.hset(store.key("acme", "old"), {"tier": "pro", "_version": "0"})
    lookup = await store.load("acme", "old")
    assert lookup.status == "stale"
    assert lookup.features.values["tier"] == "free"
    assert lookup.features.defaulted == frozenset(BATCH)


async def test_a_stored_value_that_does_not_parse_defaults_and_is_named(store) -> None:
    await store.kv.hset(
        store.key("acme", "odd"), {"request_count": "lots", "tier": "pro", "_version": "1"}
    )
    lookup = await store.load("acme", "odd")
    assert lookup.features.values["request_count"] == 0
    assert lookup.features.values["tier"] == "pro"
    assert lookup.invalid == ("request_count",)


async def test_stored_values_that_cannot_be_read_default_and_are_named_never_raise(store) -> None:
    """Bytes that are not UTF-8, a time that is not a number, a counter that is not one (a
    review's reproducers, 2026-12-05): the lookup raised, the stage degraded, and that user's
    answers were never cached."""
    await store.kv.hset(
        store.key("acme", "odd"),
        {"request_count": b"\xff\xfe", "tier": "pro", "_version": "1", "_updated": "abc"},
    )
    hour = int(time.time() // WINDOW_S)
    await store.kv.set(store.rate_key("acme", "odd", hour - 1), b"many")
    lookup = await store.load("acme", "odd")
    assert lookup.status == "hit" and lookup.age_s is None
    assert lookup.features.values["tier"] == "pro"
    assert lookup.features.values["request_count"] == 0
    assert lookup.invalid == ("request_count",)
    assert lookup.features.values["requests_last_hour"] == 1
    await store.kv.hset(store.key("acme", "other"), {"tier": "pro", "_version": b"\xff"})
    stale = await store.load("acme", "other")
    assert stale.status == "stale" and stale.features.values["tier"] == SPECS["tier"].default


async def test_a_request_log_entry_that_cannot_be_read_is_skipped(store) -> None:
    await store.load("acme", "alice", log={"lang": "en", "filters": [], "route": None})
    for damaged in (b"{not json", b"[1, 2]", b"\xff"):
        await store.kv.client.xadd(store.log_stream("acme"), {"record": damaged})
    await store.load("acme", "bob", log={"lang": "en", "filters": [], "route": None})
    assert [record["user"] for record in await store.read_log()] == ["alice", "bob"]


async def test_the_real_time_counter_counts_requests_and_slides_over_the_last_hour(
    store,
) -> None:
    counts = [
        (await store.load("acme", "bob")).features.values["requests_last_hour"] for _ in range(3)
    ]
    assert counts == [1, 2, 3]
    hour = int(time.time() // WINDOW_S)
    await store.kv.set(store.rate_key("acme", "carol", hour - 1), b"100")
    got = (await store.load("acme", "carol")).features.values["requests_last_hour"]
    expected = 1 + 100 * (1 - (time.time() % WINDOW_S) / WINDOW_S)
    assert abs(got - expected) <= 1
    ttl = await store.kv.client.ttl(store.rate_key("acme", "carol", hour))
    assert 0 < ttl <= 2 * WINDOW_S


async def test_the_request_log_holds_the_guess_and_filters_never_the_text(store) -> None:
    secret = "Qual é a senha do cofre da empresa? Não conte para ninguém"
    params = ChatParams(
        model="m",
        messages=[{"role": "user", "content": secret}],
        rag=RagOptions(filters={"department": "sales", "year": {"$gte": 2020}}, route="small"),
    )
    await store.load("acme", "alice", log=request_record(params))
    [record] = await store.read_log()
    assert record["tenant"] == "acme" and record["user"] == "alice"
    assert record["lang"] == "pt"
    assert record["filters"] == ["department=sales"]
    assert record["route"] == "small"
    assert abs(record["ts"] - time.time()) < 60
    raw = await store.kv.xrange(store.log_stream("acme"))
    stored = b" ".join(k + b"=" + v for _, fields in raw for k, v in fields.items()).decode()
    assert not any(word in stored for word in ("senha", "cofre", "ninguém", "empresa"))


async def test_the_request_log_is_capped(redis_server) -> None:
    kv = KeyValueStore.from_url(redis_server.url, TracerProvider().get_tracer("t"))
    capped = FeatureStore(kv, prefix=f"f{uuid.uuid4().hex[:8]}:", log_max_entries=100)
    try:
        # MAXLEN ~ trims whole stream nodes (100 entries each by default), hence 300 writes.
        for _ in range(300):
            await capped.load("acme", "alice", log={"lang": None, "filters": [], "route": None})
        length = await kv.xlen(capped.log_stream("acme"))
    finally:
        await kv.aclose()
    assert 100 <= length < 300


async def test_one_tenants_requests_never_push_anothers_out_of_the_request_log(
    redis_server,
) -> None:
    """Each tenant's records have a stream and a cap of their own (a hostile review,
    2026-12-05: in one shared stream capped at 100, 400 requests of one tenant left only its
    own records, so its traffic decided the other tenant's computed features). Records of the
    one stream earlier versions wrote are still read, and all come out oldest first."""
    kv = KeyValueStore.from_url(redis_server.url, TracerProvider().get_tracer("t"))
    mark = uuid.uuid4().hex[:6]
    capped = FeatureStore(kv, prefix=f"f[{mark}]*:", log_max_entries=100)
    entry = {"lang": "fr", "filters": [], "route": None}
    try:
        old = {"tenant": "beta", "user": "erin", "ts": 1.0, **entry}
        await kv.client.xadd(capped.shared_log_stream, {"record": orjson.dumps(old)})
        for _ in range(5):
            await capped.load("beta", "carol", log=entry)
        for _ in range(400):
            await capped.load("acme", "alice", log={**entry, "lang": "en"})
        # Another deployment's prefix, which the first one's read as a glob would match.
        beside = FeatureStore(kv, prefix=f"f{mark[0]}{uuid.uuid4().hex[:8]}:")
        await beside.load("gamma", "zed", log=entry)
        await kv.client.set(capped.log_stream("notes"), b"not a stream")  # skipped
        await kv.client.xadd(capped.shared_log_stream + "-other", {"record": orjson.dumps(old)})
        records = await capped.read_log()
    finally:
        await kv.aclose()
    users = [(r["tenant"], r["user"]) for r in records]
    assert users[:6] == [("beta", "erin")] + [("beta", "carol")] * 5
    assert 100 <= users.count(("acme", "alice")) < 400
    assert ("gamma", "zed") not in users
    assert [r["ts"] for r in records] == sorted(r["ts"] for r in records)


async def test_a_lookup_is_one_pipelined_redis_call(store, tracing) -> None:
    tracing[1].clear()
    await store.load("acme", "alice", log={"lang": "en", "filters": [], "route": None})
    redis_spans = [s for s in tracing[1].get_finished_spans() if s.name.startswith("redis")]
    assert [s.name for s in redis_spans] == ["redis PIPELINE features"]


# --- the stage ---


async def test_the_stage_names_used_and_defaulted_features_on_its_span(store, tracing) -> None:
    await store.write_many([FeatureRow("acme", "alice", {"tier": "pro", "department": "ops"})])
    tracing[1].clear()
    ctx = await run_stage(LoadFeatures(store, timeout_s=5.0), tracing, context())
    assert ctx.features.values["tier"] == "pro"
    span = next(s for s in tracing[1].get_finished_spans() if s.name == "stage features")
    assert span.attributes[attr.FEATURES_LOOKUP] == "hit"
    assert list(span.attributes[attr.FEATURES_USED]) == sorted(SPECS)
    assert list(span.attributes[attr.FEATURES_DEFAULTED]) == [
        "language",
        "request_count",
        "top_filter",
    ]
    assert not {"pro", "ops"} & {str(v) for v in span.attributes.values()}
    [record] = ctx.records
    assert record.status == "ok"
    assert record.info["features.defaulted"] == ["language", "request_count", "top_filter"]


async def test_a_lookup_past_its_budget_falls_back_to_defaults(tracing) -> None:
    # A real slow Redis: the server process is stopped (SIGSTOP), so it accepts nothing.
    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, tracing[0].get_tracer("t"), timeout=2.0)
    store = FeatureStore(kv, prefix="slow:")
    try:
        await store.write_many([FeatureRow("acme", "alice", {"tier": "pro"})])
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            ctx = await run_stage(LoadFeatures(store, timeout_s=0.05), tracing, context())
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        [record] = ctx.records
        assert record.status == "degraded"
        assert record.info["error_type"] == "StageTimeout"
        assert record.info["features.lookup"] == "timeout"
        assert ctx.features.defaulted == frozenset(SPECS)
        assert ctx.features.values["tier"] == "free"
        # The abandoned reply must not be read by the next lookup on a reused connection.
        again = await store.load("acme", "alice")
        assert again.features.values["tier"] == "pro"
    finally:
        await kv.aclose()
        server.stop()


async def test_a_lookup_held_up_by_a_backlogged_event_loop_is_not_past_its_budget(
    redis_server, tracing
) -> None:
    # A burst in one process: every turn of the loop takes 80 ms, longer than the stage's
    # 50 ms budget, and Redis answers 10 ms after the lookup (the proxy). The reply comes in
    # during the turn after the send and is read at the start of the next, where the budget's
    # timer is found expired too: the stage waited for the loop, not for Redis, and the lookup
    # is used. Before the budget counted the loop's lag, it degraded to the defaults.
    with FaultProxy(redis_server.url) as proxy:
        kv = KeyValueStore.from_url(proxy.url, tracing[0].get_tracer("t"), timeout=2.0)
        store = FeatureStore(kv, prefix=f"f{uuid.uuid4().hex[:8]}:")
        try:
            await store.write_many([FeatureRow("acme", "alice", {"tier": "pro"})])
            proxy.slow(0.01, responses=True)
            neighbour = asyncio.create_task(backlog(0.08, 1.0))
            try:
                ctx = await run_stage(LoadFeatures(store, timeout_s=0.05), tracing, context())
            finally:
                await neighbour
        finally:
            await kv.aclose()
    [record] = ctx.records
    assert record.status == "ok", record.info
    assert ctx.features.values["tier"] == "pro"
    # The span says how much of the stage's time was the loop's.
    span = next(s for s in tracing[1].get_finished_spans() if s.name == "stage features")
    assert span.attributes[attr.STAGE_LOOP_LAG_MS] > 50


async def test_redis_down_leaves_the_defaults_and_says_so(tracing) -> None:
    server = RedisServer()
    kv = KeyValueStore.from_url(server.url, tracing[0].get_tracer("t"))  # never started
    try:
        stage = LoadFeatures(FeatureStore(kv, prefix="down:"), timeout_s=5.0)
        ctx = await run_stage(stage, tracing, context())
    finally:
        await kv.aclose()
    [record] = ctx.records
    assert (record.status, record.info["error_type"]) == ("degraded", "StoreUnavailable")
    assert record.info["features.lookup"] == "error"
    assert ctx.features.defaulted == frozenset(SPECS)


# --- declarations, the loader and the request log ---


def test_values_are_typed_strictly_from_json_and_parsed_from_text() -> None:
    count = SPECS["request_count"]
    assert parse_value(count, 3) == 3
    assert parse_value(count, "3", text=True) == 3
    for bad in ("3", True, 2.5, None):
        with pytest.raises(FeatureValueError, match="request_count"):
            parse_value(count, bad)
    with pytest.raises(FeatureValueError):
        parse_value(count, "three", text=True)
    with pytest.raises(FeatureValueError, match="one of"):
        parse_value(SPECS["language"], "klingon")
    with pytest.raises(FeatureValueError):
        parse_value(SPECS["top_filter"], "no equals sign")
    with pytest.raises(FeatureValueError):
        parse_value(SPECS["department"], "x" * 500)


def test_a_row_with_an_unknown_or_real_time_column_or_bad_names_is_refused() -> None:
    good = parse_row({"tenant": "acme", "user": "al", "tier": "pro", "language": None}, text=False)
    assert good == FeatureRow("acme", "al", {"tier": "pro"})
    for row, why in [
        ({"tenant": "acme", "user": "al", "colour": "red"}, "unknown column"),
        ({"tenant": "acme", "user": "al", "requests_last_hour": 3}, "per request"),
        ({"tenant": "acme", "tier": "pro"}, "missing user"),
        ({"tenant": "a:b", "user": "al"}, "tenant must match"),
        ({"tenant": "acme", "user": 7}, "user must be a string"),
        ({"tenant": "acme", "user": "al", "request_count": "7"}, "expected int"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_row(row, text=False)


async def test_the_loader_writes_good_rows_and_reports_bad_lines(store, tmp_path: Path) -> None:
    jsonl = tmp_path / "features.jsonl"
    jsonl.write_text(
        '{"tenant": "acme", "user": "u1", "tier": "pro"}\n'
        '{"tenant": "acme", "user": "u2", "request_count": "many"}\n'
        "\n"
        "not json\n"
        '{"tenant": "acme", "user": "u3", "shoe_size": 44}\n'
        '{"tenant": "acme", "user": "u4", "language": "fr"}\n'
    )
    report = LoadReport()
    await write_rows(store, read_rows(jsonl, report), report, batch_size=1)
    assert report.written == 2
    assert [number for number, _ in report.bad] == [2, 4, 5]
    assert "expected int" in report.bad[0][1] and "shoe_size" in report.bad[2][1]
    assert (await store.load("acme", "u4")).features.values["language"] == "fr"
    assert (await store.load("acme", "u2")).status == "miss"

    csv = tmp_path / "features.csv"
    csv.write_text("tenant,user,tier,request_count\nacme,c1,pro,5\nacme,c2,gold,x\nacme,c3,,\n")
    report = LoadReport()
    await write_rows(store, read_rows(csv, report), report)
    assert (report.written, report.bad) == (2, [(3, "request_count: expected int, got 'x'")])
    c1 = (await store.load("acme", "c1")).features.values
    assert (c1["tier"], c1["request_count"]) == ("pro", 5)


def test_compute_derives_count_language_and_top_filter_per_user() -> None:
    records = [
        {"tenant": "acme", "user": "al", "ts": 1, "lang": "en", "filters": ["dept=x"]},
        {"tenant": "acme", "user": "al", "ts": 2, "lang": "pt", "filters": ["dept=y", "y=1"]},
        {"tenant": "acme", "user": "al", "ts": 3, "lang": "pt", "filters": ["dept=y"]},
        {"tenant": "acme", "user": "al", "ts": 4, "lang": None, "filters": []},
        {"tenant": "other", "user": "al", "ts": 5, "lang": "de", "filters": []},
        {"tenant": "bad:tenant", "user": "al", "ts": 6},
    ]
    rows, skipped = derive_rows(records)
    assert skipped == 1
    assert rows == [
        FeatureRow("acme", "al", {"request_count": 4, "language": "pt", "top_filter": "dept=y"}),
        FeatureRow("other", "al", {"request_count": 1, "language": "de"}),
    ]


def test_only_equality_filters_of_a_valid_filter_are_logged() -> None:
    assert equality_filters({"a": "x", "b": {"$eq": 2}, "c": True, "d": {"$in": [1]}}) == [
        "a=x",
        "b=2",
        "c=true",
    ]
    assert equality_filters({"a": {"$regex": "x"}}) == []
    assert equality_filters(None) == []


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("What is the capital of France and why?", "en"),
        ("Qual é a capital da França? Não sei.", "pt"),
        ("¿Cuál es la capital de Francia? No lo sé, pero muy bien.", "es"),
        ("Quelle est la capitale de la France ? Je ne sais pas.", "fr"),
        ("Was ist die Hauptstadt von Frankreich? Ich weiß es nicht.", "de"),
        ("Paris", None),
    ],
)
def test_the_language_guess(text: str, language: str | None) -> None:
    assert guess_language(text) == language
