"""`rag features load` and `rag features compute`, run as the nightly job would run them."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry import trace

from pipeline.features.store import FeatureStore, Lookup
from pipeline.store.kv import KeyValueStore
from tests.support.cli import rag

T = TypeVar("T")


def with_store(url: str, prefix: str, work: Callable[[FeatureStore], Awaitable[T]]) -> T:
    async def run() -> T:
        kv = KeyValueStore.from_url(url, trace.NoOpTracer())
        try:
            return await work(FeatureStore(kv, prefix=prefix))
        finally:
            await kv.aclose()

    return asyncio.run(run())


def lookup(url: str, prefix: str, tenant: str, user: str) -> Lookup:
    return with_store(url, prefix, lambda store: store.load(tenant, user))


def settings_env(redis_server: Any) -> tuple[dict[str, str], str]:
    prefix = f"fcli{uuid.uuid4().hex[:6]}:"
    return {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": prefix}, prefix


def test_load_writes_good_rows_and_reports_bad_lines_with_exit_code_1(
    redis_server, tmp_path: Path
) -> None:
    env, prefix = settings_env(redis_server)
    lines = [
        {"tenant": "acme", "user": "ann", "department": "sales", "language": "pt"},
        {"tenant": "acme", "user": "ben", "request_count": "twelve"},  # wrong type
        {"tenant": "acme", "user": "cat", "favourite_colour": "red"},  # unknown column
        {"tenant": "acme", "user": "../etc"},  # bad user name
        {"tenant": "acme", "user": "dan", "tier": "pro", "request_count": 12},
    ]
    features = tmp_path / "features.jsonl"
    features.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = rag("features", "load", str(features), env=env)
    assert done.returncode == 1, done.stderr
    assert f"{features}:2: skipped: request_count: expected int" in done.stderr
    assert f"{features}:3: skipped: unknown column 'favourite_colour'" in done.stderr
    assert f"{features}:4: skipped: user must match" in done.stderr
    assert "loaded features of 2 users; skipped 3 bad rows" in done.stdout
    assert "features: 100%" in done.stderr  # the progress bar ran to the end
    ann = lookup(redis_server.url, prefix, "acme", "ann").features.values
    assert (ann["department"], ann["language"]) == ("sales", "pt")
    dan = lookup(redis_server.url, prefix, "acme", "dan").features.values
    assert (dan["tier"], dan["request_count"]) == ("pro", 12)
    assert lookup(redis_server.url, prefix, "acme", "ben").status == "miss"


def test_load_of_a_clean_csv_exits_0_and_a_reload_replaces_each_user(
    redis_server, tmp_path: Path
) -> None:
    env, prefix = settings_env(redis_server)
    first = tmp_path / "first.csv"
    first.write_text("tenant,user,department,tier\nacme,ann,sales,pro\nacme,ben,ops,\n")
    done = rag("features", "load", str(first), "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert "loaded features of 2 users; skipped 0 bad rows" in done.stdout
    second = tmp_path / "second.csv"
    second.write_text("tenant,user,language\nacme,ann,de\n")
    assert rag("features", "load", str(second), "--quiet", env=env).returncode == 0
    ann = lookup(redis_server.url, prefix, "acme", "ann").features
    assert ann.values["language"] == "de"
    assert {"department", "tier"} <= ann.defaulted
    ben = lookup(redis_server.url, prefix, "acme", "ben").features
    assert (ben.values["department"], ben.values["tier"]) == ("ops", "free")


def test_compute_from_a_log_file_merges_derived_features_into_the_users(
    redis_server, tmp_path: Path
) -> None:
    env, prefix = settings_env(redis_server)
    profile = tmp_path / "profile.jsonl"
    profile.write_text('{"tenant": "acme", "user": "ann", "department": "sales"}\n')
    assert rag("features", "load", str(profile), "--quiet", env=env).returncode == 0
    log = tmp_path / "requests.jsonl"
    records = [
        {"tenant": "acme", "user": "ann", "ts": 1.0, "lang": "fr", "filters": ["topic=tax"]},
        {"tenant": "acme", "user": "ann", "ts": 2.0, "lang": "fr", "filters": ["topic=tax"]},
        {"tenant": "acme", "user": "ann", "ts": 3.0, "lang": "en", "filters": ["topic=law"]},
        {"tenant": "acme", "user": "bo", "ts": 4.0, "lang": None, "filters": []},
    ]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    done = rag("features", "compute", "--log", str(log), "--write", "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert "derived features of 2 users from 4 records" in done.stdout
    assert f"{log}:5: skipped: not JSON" in done.stderr
    ann = lookup(redis_server.url, prefix, "acme", "ann").features.values
    assert (ann["request_count"], ann["language"], ann["top_filter"]) == (3, "fr", "topic=tax")
    assert ann["department"] == "sales"  # a merge: the loaded profile stays
    assert lookup(redis_server.url, prefix, "acme", "bo").features.values["request_count"] == 1


def test_compute_reads_the_request_log_in_redis_and_writes_a_loadable_file(
    redis_server, tmp_path: Path
) -> None:
    env, prefix = settings_env(redis_server)

    async def requests(store: FeatureStore) -> None:
        for lang in ("de", "de", "es"):
            await store.load("acme", "eva", log={"lang": lang, "filters": [], "route": None})

    with_store(redis_server.url, prefix, requests)
    out = tmp_path / "derived.jsonl"
    done = rag("features", "compute", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"tenant": "acme", "user": "eva", "request_count": 3, "language": "de"}
    ]
    assert rag("features", "load", str(out), "--quiet", env=env).returncode == 0
    eva = lookup(redis_server.url, prefix, "acme", "eva").features.values
    assert (eva["language"], eva["request_count"]) == ("de", 3)


def test_compute_counts_records_without_a_tenant_as_malformed_and_derives_nothing_for_them(
    redis_server, tmp_path: Path
) -> None:
    env, _ = settings_env(redis_server)
    log = tmp_path / "requests.jsonl"
    records: list[dict[str, Any]] = [
        {"tenant": "acme", "user": "ann", "ts": 1.0, "lang": "fr", "filters": []},
        {"user": "ann", "ts": 2.0, "lang": "fr", "filters": []},  # no tenant
        {"tenant": None, "user": "ann", "ts": 3.0, "lang": "fr", "filters": []},
        {"tenant": "", "user": "ann", "ts": 4.0, "lang": "fr", "filters": []},
        {"tenant": 42, "user": "ann", "ts": 5.0, "lang": "fr", "filters": []},
        {"tenant": "acme", "user": None, "ts": 6.0, "lang": "fr", "filters": []},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "derived.jsonl"
    done = rag("features", "compute", "--log", str(log), "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert "derived features of 1 users from 6 records (5 malformed)" in done.stdout
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"tenant": "acme", "user": "ann", "request_count": 1, "language": "fr"}
    ]
