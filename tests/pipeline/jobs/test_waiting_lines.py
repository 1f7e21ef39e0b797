"""Waiting lines against a real Redis, script by script: what a hostile review of the first
version of lines found (2026-12-05), each checked where it was wrong."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry import trace

from pipeline.context import Principal
from pipeline.jobs.model import QUEUED, SUCCEEDED, Job
from pipeline.jobs.queue import SWEEP_BATCH, Delivery, JobQueue
from pipeline.jobs.worker import Deferred, JobWorker, admitted
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import make_job, wait_until
from tests.pipeline.jobs.test_worker import all_finished, running
from tests.support.servers import RedisServer

LIMITED = Principal(tenant="acme", user="alice", scopes=frozenset({"chat"}), key_id="rag-lim")
OTHER = Principal(tenant="globex", user="bob", scopes=frozenset({"chat"}), key_id="rag-other")
LINE = "k:rag-lim"


async def taken(queue: JobQueue, count: int) -> list[Delivery]:
    """The next ``count`` entries, read as a worker reads them."""
    await queue.ensure_group()
    got: list[Delivery] = []
    while len(got) < count:
        more = await queue.read("test", count=count - len(got), block_ms=1000)
        assert more, f"{count - len(got)} entries missing from the stream"
        got += more
    return got


async def park_new(queue: JobQueue, count: int, wait: float = 60.0) -> list[str]:
    """``count`` jobs of the limited key, each taken, started and deferred for ``wait``."""
    ids = [(await queue.submit(make_job(f"p{i}", LIMITED)))[0].id for i in range(count)]
    for n, delivery in enumerate(await taken(queue, count)):
        kind, *_ = await queue.start(delivery, f"lease{n}")
        if kind == "run":
            assert await queue.park(delivery, f"lease{n}", wait)
        else:
            assert kind == "waiting", kind  # the line exists: it joined at start
    return ids


async def line_of(queue: JobQueue) -> list[str]:
    members = await queue.kv.client.zrange(f"{queue.base}waiting:{LINE}", 0, -1)
    return [m.decode() for m in members]


async def test_a_line_lets_out_one_job_at_a_time_however_often_it_is_looked_at(
    queue: JobQueue,
) -> None:
    # Its line due again 0.25 s after a head went out, a key's whole line went into the stream
    # behind a backlog, every job tried at once (16 tries for 20 jobs in one run). Now a line
    # with a head out waits for that head's worker (or the fallback time).
    ids = await park_new(queue, 5, wait=0.0)
    assert await line_of(queue) == ids
    for _ in range(5):
        await queue.promote(10, fallback=30.0)
        await asyncio.sleep(0.01)
    assert await line_of(queue) == ids[1:], "one out, the others still waiting"
    assert await queue.kv.xlen(queue.stream) == 1
    # That head holds its tokens: its worker lets the next two out (a start retried after a
    # lost reply still names the line).
    (head,) = await taken(queue, 1)
    kind, _, line = await queue.start(head, "lease-h")
    assert (kind, line) == ("run", LINE) and head.job_id == ids[0]
    assert await queue.start(head, "lease-h") == ("run", 1, LINE)
    assert await queue.next_in_line(LINE, 30.0) == 2
    assert await line_of(queue) == ids[3:]
    # A job let out that is cancelled before it runs lets the next out at once.
    second, _third = await taken(queue, 2)
    assert await queue.cancel("acme", second.job_id) == "cancelled"
    assert await queue.promote(10, fallback=30.0) == 1
    assert await line_of(queue) == ids[4:]


async def test_a_line_with_room_drains_in_doubling_steps_behind_a_backlog(
    queue: JobQueue,
) -> None:
    # Each job let out joins the end of the stream: behind other tenants' backlog, a line that
    # let one job out per admission ran one job per backlog's wait (9 of 51 jobs in 40 s in a
    # review's run, the line growing). Each admission now lets two out: 1, 2, 4.
    ids = await park_new(queue, 7, wait=0.0)
    assert await queue.promote(10, fallback=30.0) == 1
    rounds = 0
    while await line_of(queue):
        rounds += 1
        out = await taken(queue, await queue.kv.xlen(queue.stream))
        for n, delivery in enumerate(out):
            kind, _, line = await queue.start(delivery, f"r{rounds}-{n}")
            assert (kind, line) == ("run", LINE)
            await queue.next_in_line(LINE, 30.0)
            await queue.finish(delivery, f"r{rounds}-{n}", SUCCEEDED, {"ok": True})
    assert rounds == 2, f"{rounds} rounds of admissions for 7 jobs (one at a time: 6)"
    assert len(ids) == 7


async def test_a_keys_later_jobs_join_its_line_and_a_lost_schedule_is_made_again(
    queue: JobQueue,
) -> None:
    # A line whose time in waiting-lines was lost (a failover, a hand deletion) held its jobs,
    # and every later job of the key, until they expired.
    first = await park_new(queue, 1, wait=60.0)
    await queue.kv.client.delete(f"{queue.base}waiting-lines")
    assert await queue.promote(10, fallback=30.0) == 0
    later, _ = await queue.submit(make_job("later", LIMITED))
    (delivery,) = await taken(queue, 1)
    assert (await queue.start(delivery, "lease-l"))[0] == "waiting"
    assert await line_of(queue) == [*first, later.id]
    job = await queue.get(later.id)
    assert job is not None and (job.status, job.attempts) == (QUEUED, 0)
    assert await queue.promote(10, fallback=30.0) == 1, "the line was made due again"


async def test_the_sweep_puts_waiting_jobs_back_in_lines_and_on_the_schedule(
    queue: JobQueue,
) -> None:
    # With no later job of the key, a lost schedule (or a lost line) stranded the waiting jobs
    # until they expired.
    ids = await park_new(queue, 2, wait=60.0)
    await queue.kv.client.delete(f"{queue.base}waiting-lines", f"{queue.base}waiting:{LINE}")
    assert await queue.sweep() == (0, 0)
    assert await line_of(queue) == ids
    assert await queue.promote(10, fallback=30.0) == 1


async def test_a_damaged_line_stops_no_worker_and_no_other_tenant(queue: JobQueue) -> None:
    # A waiting:* key of another type failed PROMOTE, every worker's every pass: "job queue
    # unreachable" for ever, no job of any tenant read.
    client = queue.kv.client
    await client.set(f"{queue.base}waiting:k:rag-broken", "not a line")
    await client.zadd(f"{queue.base}waiting-lines", {"k:rag-broken": 0})
    broken = Principal(tenant="acme", user="eve", scopes=frozenset({"chat"}), key_id="rag-broken")
    ids = [(await queue.submit(make_job("q", who)))[0].id for who in (OTHER, broken)]

    async def echo(job: Job) -> dict[str, Any]:
        return {"ok": True}

    worker = JobWorker(queue, echo, trace.NoOpTracer(), consumer="w", poll_seconds=0.2)
    async with running(worker):
        await wait_until(all_finished(queue, ids), within=30, what="both jobs")
    assert await client.zscore(f"{queue.base}waiting-lines", "k:rag-broken") is None
    # A deferral whose line, or the schedule of lines, holds another type: the damage goes,
    # the job waits as any other (before: PARK failed halfway, or retried for 15 s and the job
    # ended job_abandoned).
    await client.set(f"{queue.base}waiting:{LINE}", "damaged")
    parked = await park_new(queue, 1, wait=60.0)
    await client.delete(f"{queue.base}waiting-lines")
    await client.set(f"{queue.base}waiting-lines", "damaged")
    parked += await park_new(queue, 1, wait=60.0)
    assert await line_of(queue) == parked
    assert await client.zscore(f"{queue.base}waiting-lines", LINE) is not None


async def test_letting_a_job_out_never_trims_another_tenants_entry() -> None:
    # PROMOTE added with MAXLEN, but waiting jobs are not counted by submit's cap: a stream
    # at its cap trimmed another tenant's oldest entry (job_dropped at the next sweep).
    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, trace.NoOpTracer(), timeout=10.0)
    try:
        await kv.client.config_set("stream-node-max-entries", 1)  # trims exactly
        queue = JobQueue(kv, prefix="cap:", max_attempts=3, result_ttl=600, max_stream_length=3)
        await park_new(queue, 1, wait=0.0)
        others = [(await queue.submit(make_job(f"o{i}", OTHER)))[0].id for i in range(3)]
        assert await queue.promote(10, fallback=30.0) == 1
        assert await kv.xlen(queue.stream) == 4
        # Nor does a retry queued again (REQUEUE trimmed the stream back to its cap at once).
        out = [d for d in await taken(queue, 4) if d.job_id not in others]
        assert (await queue.start(out[0], "l"))[0] == "run"
        assert await queue.requeue(out[0], "l", None, refund=True)
        assert await queue.sweep() == (0, 0), "no entry was trimmed"
        jobs = [await queue.get(i) for i in others]
        assert all(j is not None and j.status == QUEUED for j in jobs)
        assert await kv.xlen(queue.stream) == 4
    finally:
        await kv.aclose()
        server.stop()


async def test_the_sweep_finds_a_trimmed_entry_behind_a_hundred_waiting_jobs(
    queue: JobQueue,
) -> None:
    # The sweep looks for entries gone among the 100 queued jobs that expire first: waiting
    # jobs, the oldest, filled that window, and a trimmed job stayed queued until it expired.
    await park_new(queue, SWEEP_BATCH + 1, wait=60.0)
    lost, _ = await queue.submit(make_job("lost", OTHER))
    stored = await queue.kv.client.hget(f"{queue.job_prefix}{lost.id}", "entry")
    await queue.kv.client.xdel(queue.stream, stored)
    assert await queue.sweep() == (0, 1)
    job = await queue.get(lost.id)
    assert job is not None and job.error is not None and job.error["code"] == "job_dropped"


async def test_a_line_with_room_drains_as_fast_as_its_jobs_are_admitted(queue: JobQueue) -> None:
    # A line let one job out per worker pass (a blocking read of up to poll_seconds between
    # two): 20 jobs of a key deferred once took 20 s on an idle worker of 4 slots. Now each
    # job that holds its tokens lets the next out at once.
    deferred_once: list[str] = []

    async def defer_the_first(job: Job) -> dict[str, Any]:
        if not deferred_once:
            deferred_once.append(job.id)
            raise Deferred(0.1)
        await admitted()
        return {"ok": True}

    ids = [(await queue.submit(make_job(f"q{i}", LIMITED)))[0].id for i in range(20)]
    worker = JobWorker(
        queue, defer_the_first, trace.NoOpTracer(), consumer="w", concurrency=4, poll_seconds=1.0
    )
    loop = asyncio.get_running_loop()
    async with running(worker):
        await wait_until(lambda: _line_exists(queue), within=30, what="the deferral")
        started = loop.time()
        await wait_until(all_finished(queue, ids), within=60, what="20 jobs")
        took = loop.time() - started
    jobs = [await queue.get(i) for i in ids]
    assert all(j is not None and (j.status, j.attempts) == (SUCCEEDED, 1) for j in jobs)
    assert took < 10.0, f"the line drained one job per worker pass: {took:.1f} s for 20"


async def _line_exists(queue: JobQueue) -> bool:
    return bool(await queue.kv.client.exists(f"{queue.base}waiting:{LINE}"))


async def test_a_record_whose_times_read_as_nan_neither_strands_its_job_nor_stops_the_sweep(
    queue: JobQueue,
) -> None:
    # Lua's tonumber reads "nan", which `tonumber(x) or default` let through and ZADD refused:
    # PARK failed after it had acknowledged the entry (the job in no set, found by nothing),
    # and the sweep's repair pass failed for every tenant on that one record.
    client = queue.kv.client
    first = await park_new(queue, 1, wait=0.0)
    await client.hset(f"{queue.job_prefix}{first[0]}", mapping={"created": "nan"})
    job, _ = await queue.submit(make_job("nan", LIMITED))
    await client.hset(f"{queue.job_prefix}{job.id}", mapping={"created": "nan", "expires": "nan"})
    (delivery,) = await taken(queue, 1)
    assert (await queue.start(delivery, "l"))[0] == "waiting"
    assert set(await line_of(queue)) == {first[0], job.id}
    await client.delete(f"{queue.base}waiting:{LINE}")
    assert await queue.sweep() == (0, 0)
    assert set(await line_of(queue)) == {first[0], job.id}, "the sweep put both back"
    assert await queue.promote(10, fallback=30.0) == 1
    (out,) = await taken(queue, 1)
    kind, _, line = await queue.start(out, "l2")
    assert (kind, line) == ("run", LINE)
    assert await queue.park(out, "l2", 60.0), "parked whole, not halfway"
    assert await client.zscore(f"{queue.base}parked", out.job_id) is not None
