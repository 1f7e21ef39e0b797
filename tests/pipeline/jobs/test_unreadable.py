"""What another version (or damage) leaves in Redis, against a real Redis: a stream entry, a job
record or key, or a webhook secret that this code cannot read is logged and taken as absent or
failed. It never stops a worker, makes one retry it forever, or hides the other jobs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from opentelemetry import trace

from pipeline.jobs.model import FAILED, SUCCEEDED, Job, JobUnreadable
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.signing import SecretUnreadable, WebhookSecrets
from pipeline.jobs.urls import UrlPolicy
from pipeline.jobs.webhooks import WebhookSender
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import BOB, make_job, wait_until
from tests.pipeline.jobs.receiver import Receiver
from tests.pipeline.jobs.test_worker import all_finished, running, worker

Damage = Callable[[KeyValueStore, str], Awaitable[Any]]


def overwrite(field: str, value: bytes) -> Damage:
    async def damage(kv: KeyValueStore, key: str) -> None:
        await kv.client.hset(key, field, value)

    return damage


async def without_tenant(kv: KeyValueStore, key: str) -> None:
    await kv.client.hdel(key, "tenant")


DAMAGED = {
    "created-not-a-number": overwrite("created", b"abc"),
    "created-infinite": overwrite("created", b"inf"),
    "status-not-utf8": overwrite("status", b"\xff"),
    "metadata-not-json": overwrite("metadata", b"{x"),
    "request-not-an-object": overwrite("request", b"[1]"),
    "deliveries-not-a-list": overwrite("deliveries", b'{"a": 1}'),
    "tenant-missing": without_tenant,
}


async def echo(job: Job) -> dict[str, Any]:
    return {"echo": job.request["messages"][0]["content"]}


async def raw(kv: KeyValueStore, queue: JobQueue, job_id: str) -> dict[bytes, bytes]:
    return await kv.hgetall(queue.job_prefix + job_id)


async def pending(kv: KeyValueStore, queue: JobQueue) -> int:
    return int((await kv.client.xpending(queue.stream, "workers"))["pending"])


# --- stream entries ---


async def test_a_stream_entry_without_a_readable_job_id_is_dropped_and_its_batch_runs(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    first, _ = await queue.submit(make_job("first"))
    await kv.client.xadd(queue.stream, {"id": b"\xff\xfe"})
    second, _ = await queue.submit(make_job("second"))
    async with running(worker(queue, echo, "w", concurrency=4)):
        await wait_until(all_finished(queue, [first.id, second.id]), 10, "the good jobs to run")
        await wait_until(lambda: _drained(queue), 10, "the bad entry to be dropped")
    assert await pending(kv, queue) == 0


async def test_a_reclaimed_entry_without_a_readable_job_id_is_acknowledged(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    await queue.ensure_group()
    await kv.client.xadd(queue.stream, {"id": b"\xff"})
    # Another replica read it and died (or died on it): it waits in that consumer's pending list.
    await kv.client.xreadgroup("workers", "dead", {queue.stream: ">"}, count=1)
    assert await queue.reclaim("w", min_idle_ms=0, count=10) == []
    assert await pending(kv, queue) == 0 and await queue.backlog() == 0


async def test_the_worker_loop_logs_an_unexpected_error_and_goes_on(
    queue: JobQueue, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sweep = queue.sweep
    calls = 0

    async def failing_once() -> tuple[int, int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a fault no handler foresaw")
        return await sweep()

    monkeypatch.setattr(queue, "sweep", failing_once)
    job, _ = await queue.submit(make_job("after the fault"))
    with caplog.at_level(logging.ERROR, logger="rag.jobs"):
        async with running(worker(queue, echo, "w", sweep_seconds=0.1)):
            await wait_until(all_finished(queue, [job.id]), 10, "the job to run after the fault")
    assert any("unexpected error" in r.getMessage() for r in caplog.records)
    assert calls >= 2, "the loop went on sweeping"


# --- job records ---


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
async def test_a_damaged_record_is_unreadable_and_left_out_of_listings(
    queue: JobQueue, kv: KeyValueStore, damage: Damage
) -> None:
    good, _ = await queue.submit(make_job("good"))
    bad, _ = await queue.submit(make_job("bad"))
    await damage(kv, queue.job_prefix + bad.id)
    with pytest.raises(JobUnreadable) as raised:
        await queue.get(bad.id)
    assert raised.value.job_id == bad.id and raised.value.status_code == 503
    listed, more, _ = await queue.page("acme", limit=10, after=None)
    assert [j.id for j in listed] == [good.id] and not more
    assert await queue.get_for("globex", bad.id) is None, "another tenant learns nothing"


async def test_a_page_of_only_unreadable_records_still_says_where_to_go_on_from(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    """Its listing is empty with more to come: without the id of the last record left out, a
    client had no cursor and could not page past the damage."""
    good, _ = await queue.submit(make_job("good"))
    bad = [(await queue.submit(make_job(f"bad {n}")))[0] for n in range(2)]
    for job in bad:
        await kv.client.hset(queue.job_prefix + job.id, "created", "abc")
    listed, more, cursor = await queue.page("acme", limit=2, after=None)
    assert listed == [] and more and cursor == bad[0].id  # newest first
    rest, more, _ = await queue.page("acme", limit=2, after=cursor)
    assert [j.id for j in rest] == [good.id] and not more


async def test_an_unreadable_record_is_a_503_only_for_its_owner(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    bad, _ = await queue.submit(make_job("bad"))
    await kv.client.hset(queue.job_prefix + bad.id, "created", "abc")
    with pytest.raises(JobUnreadable):
        await queue.get_for("acme", bad.id, "alice")
    assert await queue.get_for("acme", bad.id, "mallory") is None
    assert await queue.get_for(BOB.tenant, bad.id) is None


async def test_a_listing_skips_a_job_key_of_another_type(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    good, _ = await queue.submit(make_job("good"))
    bad, _ = await queue.submit(make_job("bad"))
    await kv.client.delete(queue.job_prefix + bad.id)
    await kv.client.set(queue.job_prefix + bad.id, "not a hash")
    listed, _, _ = await queue.page("acme", limit=10, after=None)
    assert [j.id for j in listed] == [good.id]


async def test_a_job_key_of_another_type_is_nobodys_job(queue: JobQueue, kv: KeyValueStore) -> None:
    bad, _ = await queue.submit(make_job("bad"))
    await kv.client.delete(queue.job_prefix + bad.id)
    await kv.client.set(queue.job_prefix + bad.id, "not a hash")
    assert await queue.get_for("acme", bad.id, "alice") is None
    assert await queue.get_for(BOB.tenant, bad.id) is None


async def test_a_job_whose_record_cannot_be_read_fails_once_and_is_acknowledged(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    good, _ = await queue.submit(make_job("good"))
    bad, _ = await queue.submit(make_job("bad"))
    hooked, _ = await queue.submit(make_job("hooked", webhook_url="https://example.com/hook"))
    for job in (bad, hooked):
        await kv.client.hset(queue.job_prefix + job.id, "created", "abc")
    ran: list[str] = []

    async def execute(job: Job) -> dict[str, Any]:
        ran.append(job.id)
        return await echo(job)

    async with running(worker(queue, execute, "w", concurrency=4)):
        await wait_until(all_finished(queue, [good.id]), 10, "the good job to run")
        await wait_until(lambda: _drained(queue), 10, "the damaged jobs to be acknowledged")
    assert ran == [good.id], "a job that cannot be read is never run"
    for job in (bad, hooked):
        record = await raw(kv, queue, job.id)
        assert record[b"status"] == FAILED.encode()
        assert b"job_unreadable" in record[b"error"]
    assert (await raw(kv, queue, hooked.id))[b"webhook_state"] == b"failed"
    assert await pending(kv, queue) == 0


async def test_start_takes_a_job_whose_attempts_or_expiry_do_not_parse(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    counted, _ = await queue.submit(make_job("attempts"))
    expiring, _ = await queue.submit(make_job("expires"))
    await kv.client.hset(queue.job_prefix + counted.id, "attempts", "abc")
    await kv.client.hset(queue.job_prefix + expiring.id, "expires", "abc")
    await queue.ensure_group()
    deliveries = await queue.read("w", count=10, block_ms=100)
    assert [await queue.start(d, "lease") for d in deliveries] == [("run", 1, ""), ("run", 1, "")]
    started = await queue.get(counted.id)
    assert started is not None and started.attempts == 1, "the count is written anew"


async def test_a_job_with_unparsable_attempts_runs_to_the_end(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    job, _ = await queue.submit(make_job("attempts"))
    await kv.client.hset(queue.job_prefix + job.id, "attempts", "abc")

    async def succeeded() -> bool:  # `get` cannot read it until `start` writes the count anew
        return (await raw(kv, queue, job.id)).get(b"status") == SUCCEEDED.encode()

    async with running(worker(queue, echo, "w")):
        await wait_until(succeeded, 10, "the job to run")
    done = await queue.get(job.id)
    assert done is not None and done.status == SUCCEEDED and done.attempts == 1


async def test_an_entry_whose_job_key_is_not_a_hash_is_acknowledged(
    queue: JobQueue, kv: KeyValueStore
) -> None:
    job, _ = await queue.submit(make_job("bad"))
    await kv.client.delete(queue.job_prefix + job.id)
    await kv.client.set(queue.job_prefix + job.id, "not a hash")
    await queue.ensure_group()
    [delivery] = await queue.read("w", count=10, block_ms=100)
    assert await queue.start(delivery, "lease") == ("gone", 0, "")
    assert await pending(kv, queue) == 0


async def test_a_job_key_of_another_type_does_not_stop_the_sweep_for_everyone(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = JobQueue(kv, prefix=prefix, result_ttl=600, queued_ttl=0.3)
    damaged, _ = await queue.submit(make_job("acme's"))
    other, _ = await queue.submit(make_job("globex's", principal=BOB))
    await kv.client.delete(queue.job_prefix + damaged.id)
    await kv.client.set(queue.job_prefix + damaged.id, "not a hash")
    await asyncio.sleep(0.5)
    assert await queue.sweep() == (1, 0)
    expired = await queue.get(other.id)
    assert expired is not None and expired.status == FAILED
    assert await kv.client.zscore(queue.queued, damaged.id) is None, "its id was dropped"
    assert await queue.sweep() == (0, 0)


async def _drained(queue: JobQueue) -> bool:
    return await queue.backlog() == 0


# --- webhook secrets ---


@pytest.fixture
def secrets(kv: KeyValueStore, prefix: str) -> WebhookSecrets:
    return WebhookSecrets(kv, prefix=prefix, grace_seconds=3600)


async def test_a_webhook_secret_that_is_not_text_is_unreadable(
    secrets: WebhookSecrets, kv: KeyValueStore
) -> None:
    await kv.client.hset(secrets.prefix + "acme", "current", b"\xff\xfe")
    with pytest.raises(SecretUnreadable, match="not text"):
        await secrets.signing("acme")
    with pytest.raises(SecretUnreadable, match="not text"):
        await secrets.current("acme")


async def test_a_grace_period_end_that_is_not_a_number_is_unreadable(
    secrets: WebhookSecrets, kv: KeyValueStore
) -> None:
    await kv.client.hset(
        secrets.prefix + "acme",
        mapping={"current": "whsec_x", "previous": "whsec_y", "previous_until": "soon"},
    )
    with pytest.raises(SecretUnreadable, match="not a number"):
        await secrets.signing("acme")


async def test_a_delivery_with_an_unreadable_secret_records_a_failed_attempt(
    secrets: WebhookSecrets, kv: KeyValueStore
) -> None:
    await kv.client.hset(secrets.prefix + "acme", "current", b"\xff")
    recorded: list[list[dict[str, Any]]] = []

    async def record(deliveries: list[dict[str, Any]]) -> None:
        recorded.append(list(deliveries))

    with Receiver() as receiver:
        sender = WebhookSender(
            secrets, UrlPolicy(["127.0.0.1/32"]), trace.NoOpTracer(), max_attempts=1, timeout=5.0
        )
        try:
            assert not await sender.deliver(make_job("q", webhook_url=receiver.url), record)
        finally:
            await sender.aclose()
    assert receiver.received == [], "nothing unsigned was sent"
    [attempt] = recorded[-1]
    assert attempt["outcome"] == FAILED and "SecretUnreadable" in attempt["error"]
