"""Quotas and lifetime of queued jobs against a real Redis: the queued TTL, the sweep, the
stream's cap and what trimming does to unread entries, per-tenant limits shared by replicas,
per-user visibility, revoked keys' queued jobs, and Redis losing its data under a worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry import trace

from pipeline.context import Principal
from pipeline.jobs.model import CANCELLED, FAILED, QUEUED, SUCCEEDED, Job
from pipeline.jobs.queue import JobQueue, QueueFull, TooManyJobs
from pipeline.jobs.worker import JobWorker
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import ALICE, BOB, make_job, wait_until
from tests.pipeline.jobs.test_worker import all_finished, running, worker
from tests.pipeline.jobs.worker_process import counting_execute
from tests.support.servers import RedisServer

ALICE_OTHER_KEY = Principal("acme", "alice", frozenset({"chat"}), key_id="key_" + "a" * 24)
CAROL = Principal("acme", "carol", frozenset({"chat"}), key_id="key_" + "c" * 24)


def queue_on(kv: KeyValueStore, prefix: str, **options: Any) -> JobQueue:
    options.setdefault("result_ttl", 600)
    return JobQueue(kv, prefix=prefix, **options)


async def runs(kv: KeyValueStore, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await kv.hgetall(f"{prefix}counts")).items()}


async def test_a_job_not_started_within_its_ttl_expires_and_is_never_run(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix, queued_ttl=0.3)
    stale, _ = await queue.submit(make_job("stale"))
    await asyncio.sleep(0.5)  # past its TTL before any worker reads the stream
    async with running(worker(queue, counting_execute(kv, prefix, "w", 0), "w")):
        await wait_until(all_finished(queue, [stale.id]), what="the stale job to be settled")
        # Submitted with a day to live (the expiry is the job's own, set at submit).
        fresh, _ = await queue_on(kv, prefix).submit(make_job("fresh"))
        await wait_until(all_finished(queue, [fresh.id]), what="a fresh job to run")
    expired = await queue.get(stale.id)
    assert expired is not None and expired.status == FAILED and expired.attempts == 0
    assert expired.error is not None and expired.error["code"] == "job_expired"
    assert "not started within 0.3 s" in expired.error["message"]
    assert await runs(kv, prefix) == {fresh.id: 1}, "the expired job never ran"
    assert await queue.backlog() == 0, "its entry was acknowledged and deleted"
    assert 0 < await kv.client.ttl(queue.job_prefix + stale.id) <= 600


async def test_a_worker_that_reads_an_expired_job_settles_it_instead_of_running_it(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix, queued_ttl=0.3)
    stale, _ = await queue.submit(make_job("stale"))
    shown = await queue.get(stale.id)
    assert shown is not None and shown.public()["expires_at"] == int(shown.expires or 0)
    await queue.ensure_group()
    [delivery] = await queue.read("w", count=1, block_ms=100)
    await asyncio.sleep(0.5)
    assert await queue.start(delivery, "lease") == ("expired", 0, "")
    expired = await queue.get(stale.id)
    assert expired is not None and expired.status == FAILED
    assert expired.error is not None and expired.error["code"] == "job_expired"
    assert expired.public()["expires_at"] is None
    assert await queue.backlog() == 0
    pending = await kv.client.xpending(queue.stream, "workers")
    assert pending["pending"] == 0, "acknowledged"


async def test_the_sweep_settles_expired_jobs_and_frees_the_tenants_quota(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix, queued_ttl=0.3, max_queued_per_tenant=2)
    ids = [(await queue.submit(make_job(f"q{i}")))[0].id for i in range(2)]
    await asyncio.sleep(0.5)
    assert await queue.sweep() == (2, 0)
    assert await queue.sweep() == (0, 0), "each job is settled once"
    for job_id in ids:
        job = await queue.get(job_id)
        assert job is not None and job.status == FAILED
        assert job.error is not None and job.error["code"] == "job_expired"
    assert await queue.backlog() == 0, "the expired entries were deleted"
    lasting = queue_on(kv, prefix, max_queued_per_tenant=2)  # jobs with a day to live
    for i in range(2):
        assert (await lasting.submit(make_job(f"room {i}")))[1], "expired jobs do not count"
    with pytest.raises(TooManyJobs):
        await lasting.submit(make_job("one too many"))


async def test_a_trimmed_entry_fails_its_job_at_the_next_sweep(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix)
    lost = [(await queue.submit(make_job(f"lost {i}")))[0].id for i in range(2)]
    # What the cap does to entries nobody has read yet: they are cut from the stream.
    await kv.client.xtrim(queue.stream, maxlen=0)
    kept, _ = await queue.submit(make_job("kept"))
    assert await queue.sweep() == (0, 2)
    for job_id in lost:
        job = await queue.get(job_id)
        assert job is not None and job.status == FAILED
        assert job.error is not None and job.error["code"] == "job_dropped"
    still = await queue.get(kept.id)
    assert still is not None and still.status == QUEUED


async def test_the_stream_cap_stops_submit_and_a_requeue_trims_no_one() -> None:
    """Submit stops at the cap. A requeue past it once made XADD ... MAXLEN ~ trim the oldest
    entries (in whole nodes: two entries each on this server), other jobs', which the sweep then
    failed (job_dropped); a requeue replaces its own job's entry, and now trims no one."""
    redis = RedisServer()
    redis.start()
    kv = KeyValueStore.from_url(redis.url, trace.NoOpTracer())
    try:
        await kv.client.config_set("stream-node-max-entries", 2)
        queue = queue_on(kv, "cap:", max_stream_length=4)
        ids = [(await queue.submit(make_job(f"q{i}")))[0].id for i in range(4)]
        with pytest.raises(QueueFull):
            await queue.submit(make_job("one too many"))
        assert await queue.backlog() == 4
        await queue.ensure_group()
        [taken] = await queue.read("w", count=1, block_ms=100)
        assert taken.job_id == ids[0]
        for attempt in range(3):
            kind, *_ = await queue.start(taken, f"lease{attempt}")
            assert kind == "run"
            assert await queue.requeue(taken, f"lease{attempt}", None, refund=True)
            [taken] = [
                d for d in await queue.read("w", count=10, block_ms=100) if d.job_id == ids[0]
            ]
        assert await queue.backlog() == 4, "each requeue replaced its own entry"
        assert await queue.sweep() == (0, 0)
        statuses = {i: (await queue.get(i)).status for i in ids}  # type: ignore[union-attr]
        assert list(statuses.values()) == [QUEUED] * 4
    finally:
        await kv.aclose()
        redis.stop()


async def test_the_tenants_queued_limit_counts_queued_jobs_only(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix, max_queued_per_tenant=2)
    first, _ = await queue.submit(make_job("1"))
    second, _ = await queue.submit(make_job("2"))
    with pytest.raises(TooManyJobs) as refused:
        await queue.submit(make_job("3"))
    assert refused.value.code == "too_many_queued_jobs" and refused.value.retry_after >= 1
    assert (await queue.submit(make_job("theirs", principal=BOB)))[1], "another tenant's own"
    assert await queue.cancel("acme", second.id) == CANCELLED
    await queue.ensure_group()
    [delivery, *_] = await queue.read("w", count=1, block_ms=100)
    assert await queue.start(delivery, "lease") == ("run", 1, "")  # running: no longer queued
    assert (await queue.submit(make_job("4")))[1]
    assert (await queue.submit(make_job("5")))[1]
    with pytest.raises(TooManyJobs):
        await queue.submit(make_job("6"))
    assert len((await queue.page("acme", limit=100, after=None))[0]) == 4, "refusals not stored"
    assert first.id


async def test_the_submit_rate_is_shared_by_every_replica(kv: KeyValueStore, prefix: str) -> None:
    one, two = (queue_on(kv, prefix, submit_rate=0.05, submit_burst=3) for _ in range(2))
    await one.take_submit_token("acme")
    await two.take_submit_token("acme")
    await one.take_submit_token("acme")
    for replica in (one, two):
        with pytest.raises(TooManyJobs) as refused:
            await replica.take_submit_token("acme")
        assert refused.value.code == "rate_limit_exceeded"
        assert 0 < refused.value.retry_after <= 20.0  # one token every 20 s
    await two.take_submit_token("globex")  # a bucket per tenant


async def test_a_job_belongs_to_its_user_and_is_listed_per_user(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix)
    alices = [(await queue.submit(make_job(f"a{i}")))[0].id for i in range(2)]
    via_other_key = (await queue.submit(make_job("a2", principal=ALICE_OTHER_KEY)))[0].id
    carols = (await queue.submit(make_job("c", principal=CAROL)))[0].id
    mine, _, _ = await queue.page("acme", limit=10, after=None, user="alice")
    assert [j.id for j in mine] == [via_other_key, *alices[::-1]], "a user's jobs, any key"
    theirs, _, _ = await queue.page("acme", limit=10, after=None, user="carol")
    assert [j.id for j in theirs] == [carols]
    everyone, _, _ = await queue.page("acme", limit=10, after=None)
    assert len(everyone) == 4
    assert await queue.get_for("acme", carols, "alice") is None
    assert await queue.get_for("acme", carols, "carol") is not None
    assert await queue.get_for("acme", carols) is not None, "the tenant-wide view"
    assert await queue.cancel("acme", carols, "alice") == "missing"
    assert await queue.cancel("acme", carols, "carol") == CANCELLED
    with pytest.raises(KeyError):
        await queue.page("acme", limit=10, after=carols, user="alice")


async def test_idempotency_keys_are_per_user(kv: KeyValueStore, prefix: str) -> None:
    queue = queue_on(kv, prefix)
    first, _ = await queue.submit(make_job("same"), "line-1")
    carols, created = await queue.submit(make_job("same", principal=CAROL), "line-1")
    assert created and carols.id != first.id, "carol is not handed alice's job"


async def test_revoking_a_key_settles_its_queued_jobs_and_they_never_run(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix)
    revoked = [(await queue.submit(make_job(f"r{i}")))[0].id for i in range(2)]
    kept = (await queue.submit(make_job("k", principal=ALICE_OTHER_KEY)))[0].id
    assert await queue.settle_revoked("acme", ALICE.key_id) == 2
    async with running(worker(queue, counting_execute(kv, prefix, "w", 0), "w")):
        await wait_until(all_finished(queue, [*revoked, kept]), what="every job to settle")
        await wait_until(lambda: _drained(queue), what="the stream to drain")
    assert await runs(kv, prefix) == {kept: 1}, "the revoked key's jobs never ran"
    for job_id in revoked:
        job = await queue.get(job_id)
        assert job is not None and job.status == FAILED and job.attempts == 0
        assert job.error is not None and job.error["code"] == "key_revoked"
        assert job.error["type"] == "authentication_error"


async def test_a_settled_job_with_a_webhook_gets_an_entry_to_deliver_it(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = queue_on(kv, prefix)
    job, _ = await queue.submit(make_job("hooked", webhook_url="https://hooks.example.com/x"))
    await kv.client.xtrim(queue.stream, maxlen=0)
    assert await queue.sweep() == (0, 1)
    settled = await queue.get(job.id)
    assert settled is not None and settled.webhook_state == "pending"
    await queue.ensure_group()
    [delivery] = await queue.read("w", count=10, block_ms=100)
    assert delivery.job_id == job.id
    assert (await queue.start(delivery, "lease"))[0] == "deliver"


async def _drained(queue: JobQueue) -> bool:
    return await queue.backlog() == 0


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    redis = RedisServer()  # no persistence: a restart loses everything
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


@pytest.mark.parametrize("loss", ["flushall", "restart"])
async def test_workers_recreate_the_consumer_group_when_redis_loses_its_data(
    own_redis: RedisServer, loss: str
) -> None:
    kv = KeyValueStore.from_url(own_redis.url, trace.NoOpTracer(), retry_after=0.2)
    queue = queue_on(kv, "lost:")
    done: list[str] = []

    async def execute(job: Job) -> dict[str, Any]:
        done.append(job.id)
        return {"ok": True}

    w = JobWorker(queue, execute, trace.NoOpTracer(), consumer="w", poll_seconds=0.2)
    try:
        async with running(w):
            before, _ = await queue.submit(make_job("before"))
            await wait_until(all_finished(queue, [before.id]), what="the first job")
            if loss == "flushall":
                await kv.client.flushall()
            else:
                own_redis.stop()
                own_redis.start()
            # The data is gone (the running worker may already have made the group again, so
            # the stream is not what shows it: the first job's record is).
            assert await kv.client.exists(queue.job_prefix + before.id) == 0, "the data is gone"

            async def submitted() -> bool:
                try:
                    after.append((await queue.submit(make_job("after")))[0])
                except Exception:
                    return False
                return True

            after: list[Job] = []
            await wait_until(submitted, what="a submit after the loss")
            await wait_until(all_finished(queue, [after[0].id]), what="a job after the loss")
        job = await queue.get(after[0].id)
        assert job is not None and job.status == SUCCEEDED and done == [before.id, job.id]
    finally:
        await kv.aclose()
