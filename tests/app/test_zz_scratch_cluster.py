"""SCRATCH (untracked, to be deleted): reproducers for the Redis Cluster review."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from opentelemetry import trace

from pipeline.errors import StoreUnavailable
from pipeline.store.kv import KeyValueStore
from pipeline.store.singleflight import SingleFlight


def flush_scripts(cluster) -> None:
    for node in cluster.nodes:
        redis.Redis(port=node.port).script_flush()


async def test_concurrent_first_pipelines_race_the_script_load(redis_cluster) -> None:
    flush_scripts(redis_cluster)
    kv = KeyValueStore.from_url(redis_cluster.url, trace.NoOpTracer(), timeout=5.0, cluster=True)
    try:
        flights = SingleFlight(kv, prefix=f"p{uuid.uuid4().hex[:6]}:")
        readers = [flights.readers_key(f"k{n}", "tok") for n in range(8)]

        def counting(name):
            async def queue(pipe):
                await flights.reading_script(keys=[name], args=["me", 5000], client=pipe)
            return queue

        results = await asyncio.gather(
            *(kv.pipeline("reading", counting(r)) for r in readers), return_exceptions=True
        )
        failed = [repr(r) for r in results if isinstance(r, BaseException)]
        print("\nfailed pipelines:", len(failed), "of", len(results), failed[:2])
        assert not failed
    finally:
        await kv.aclose()


async def test_a_transaction_after_a_script_flush_recovers(redis_cluster) -> None:
    kv = KeyValueStore.from_url(redis_cluster.url, trace.NoOpTracer(), timeout=5.0, cluster=True)
    try:
        flights = SingleFlight(kv, prefix=f"p{uuid.uuid4().hex[:6]}:")
        lock, stream = flights.lock_key("k"), flights.stream_key("k", "tok")

        async def publish(pipe):
            pipe.xadd(stream, {"e": "x"}, maxlen=1)
            pipe.pexpire(stream, 10_000)
            await flights.release_script(keys=[lock], args=["tok"], client=pipe)

        await kv.pipeline("flight_publish", publish, transaction=True)
        flush_scripts(redis_cluster)
        outcomes = []
        for _ in range(3):
            try:
                await kv.pipeline("flight_publish", publish, transaction=True)
                outcomes.append("ok")
            except StoreUnavailable as exc:
                outcomes.append(f"{exc.detail} cause={type(exc.__cause__).__name__}")
        print("\ntransaction outcomes after flush:", outcomes)
        assert outcomes[1:] == ["ok", "ok"]
    finally:
        await kv.aclose()


from tests.support.cli import rag  # noqa: E402


def test_cli_on_cluster(redis_cluster, tmp_path) -> None:
    prefix = f"c{uuid.uuid4().hex[:6]}:"
    env = {"RAG_REDIS__URL": redis_cluster.url, "RAG_REDIS__KEY_PREFIX": prefix,
           "RAG_REDIS__CLUSTER": "true"}
    out = {}
    made = rag("keys", "create", "--tenant", "acme", "--user", "ann", "--scopes", "chat", env=env)
    out["create"] = (made.returncode, made.stderr[-300:])
    raw = made.stdout.strip()
    for args in (
        ("keys", "list", "--tenant", "acme"),
        ("keys", "list", "--tenant", "acme", "--rescan"),
        ("keys", "limits", raw, "--rpm", "5"),
        ("keys", "groups", raw, "--set", "g1,g2"),
        ("keys", "tenant-limits", "acme", "--rpm", "7"),
        ("webhooks", "secret", "--tenant", "acme"),
        ("webhooks", "secret", "--tenant", "acme", "--rotate"),
        ("keys", "revoke", raw),
    ):
        done = rag(*args, env=env)
        out[" ".join(args[:2])] = (done.returncode, done.stdout[-200:], done.stderr[-400:])
    rows = tmp_path / "f.jsonl"
    rows.write_text('{"tenant": "acme", "user": "ann", "request_count": 3}\n')
    done = rag("features", "load", str(rows), "--quiet", env=env)
    out["features load"] = (done.returncode, done.stdout[-200:], done.stderr[-400:])
    done = rag("features", "compute", "--write", "--quiet", env=env)
    out["features compute"] = (done.returncode, done.stdout[-200:], done.stderr[-400:])
    for k, v in out.items():
        print("\n", k, "->", v)
    assert all(v[0] == 0 for v in out.values())
