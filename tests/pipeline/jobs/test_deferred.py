"""A key's queued jobs hold their estimated tokens as its chat requests do: a job whose key's
token window is full is not run but queued again (its attempt given back) in its key's waiting
line, outside the stream, and runs once the window has room, first come first served."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry import trace

from app.jobs import run_job
from pipeline.context import Completion, Principal, RequestContext
from pipeline.errors import AuthenticationFailed
from pipeline.jobs.model import FAILED, QUEUED, SUCCEEDED, Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.worker import Deferred, JobWorker
from pipeline.runner import Runner, StageSpec
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from pipeline.store.limits import LimitConfig, RateLimiter
from pipeline.telemetry import attributes as attr
from tests.conftest import make_settings
from tests.pipeline.jobs.conftest import make_job, wait_until
from tests.pipeline.jobs.test_worker import all_finished, running
from tests.support.tracing import memory_tracing

# 3,000 tokens a minute over a 2 s window: 100 tokens a window.
WINDOW_S, TPM = 2.0, 3000
QUESTION = "q" * 40  # 10 tokens at four characters a token
MAX_TOKENS = 30  # so each job's estimate, and its answer's usage, is 40 tokens


class Answer:
    """The whole path of a job here: an answer that used 40 tokens, and when it was made."""

    spec = StageSpec.of("answer", writes={"completion", "answer", "finished"})

    def __init__(self) -> None:
        self.ran: list[float] = []

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        self.ran.append(asyncio.get_running_loop().time())
        ctx.respond(
            Completion(
                content="ok",
                finish_reason="stop",
                model="m",
                prompt_tokens=10,
                completion_tokens=30,
            )
        )
        return ctx


def limited(tenant: str) -> Principal:
    return Principal(
        tenant=tenant, user="alice", scopes=frozenset({"chat"}), key_id=f"rag-{tenant}", tpm=TPM
    )


def job_of(who: Principal, n: int) -> Job:
    question = f"{n}{QUESTION}"[:40]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}]}
    return Job.create(who, {**body, "max_tokens": MAX_TOKENS}, max_attempts=1)


async def test_a_keys_jobs_wait_for_room_in_its_token_window_and_each_runs_once(
    queue: JobQueue, kv: KeyValueStore, prefix: str, redis_server
) -> None:
    # Before, a job was charged when it ran but never held its estimate: a key's queued jobs
    # all ran at once, whatever its tokens-per-minute limit (6 jobs of 40 tokens against 100 a
    # window: 240 tokens in the first window).
    settings = make_settings(redis_server.url, "http://127.0.0.1:9")
    limits = RateLimiter(kv, LimitConfig(window_seconds=WINDOW_S), prefix=prefix)
    answer = Answer()
    runner = Runner([answer], trace.NoOpTracer())
    provider, exporter = memory_tracing()

    async def execute(job: Job) -> dict[str, Any]:
        return await run_job(settings, runner, job, limits)

    who = limited(f"acme{prefix}")
    ids = [(await queue.submit(job_of(who, n)))[0].id for n in range(6)]
    # Two workers of two slots: a deferred job is taken over by either (XAUTOCLAIM after the
    # visibility timeout of 1 s, looked for every 0.5 s).
    workers = [
        JobWorker(
            queue,
            execute,
            provider.get_tracer("t"),
            consumer=f"w{i}",
            concurrency=2,
            poll_seconds=0.2,
            visibility_timeout=1.0,
        )
        for i in range(2)
    ]
    async with running(*workers):
        await wait_until(all_finished(queue, ids), within=60, what="6 jobs to finish")
    jobs = [await queue.get(i) for i in ids]
    assert [(j.status, j.attempts) for j in jobs if j is not None] == [(SUCCEEDED, 1)] * 6, (
        "each job ran once; its deferrals gave back their attempts (at most 1 allowed)"
    )
    ran = sorted(answer.ran)
    assert len(ran) == 6
    # The window admits while it holds under 100 tokens: 0, 40, 80 (three jobs), then the
    # fourth waits until the first three's tokens leave it, a window later.
    assert ran[3] - ran[0] >= WINDOW_S * 0.75, f"the fourth job ran {ran[3] - ran[0]:.2f} s after"
    outcomes = [s.attributes.get(attr.JOB_OUTCOME) for s in exporter.get_finished_spans()]
    assert outcomes.count("finished") == 6 and outcomes.count("deferred") >= 1
    deferred = [
        s for s in exporter.get_finished_spans() if s.attributes.get(attr.JOB_OUTCOME) == "deferred"
    ]
    assert all(0 < s.attributes[attr.JOB_DEFERRED_MS] <= WINDOW_S * 1000 for s in deferred)
    assert await queue.backlog() == 0


async def test_a_deferred_job_is_queued_as_before_it_was_taken_and_runs_after_its_wait(
    queue: JobQueue,
) -> None:
    # The worker's side alone: a job its execute defers is queued again (status, attempt, no
    # start time, the tenant's queued set) in its key's waiting line, holding no stream entry,
    # and is put back in the stream no sooner than its wait.
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def defer_once(job: Job) -> dict[str, Any]:
        calls.append(loop.time())
        if len(calls) == 1:
            raise Deferred(0.9)
        return {"ok": True}

    job, _ = await queue.submit(make_job("later", max_attempts=1))
    worker = JobWorker(queue, defer_once, trace.NoOpTracer(), consumer="w", poll_seconds=0.2)
    async with running(worker):
        await wait_until(lambda: _waiting(queue, job.id, calls), within=30, what="the deferral")
        await wait_until(all_finished(queue, [job.id]), within=30, what="the job to finish")
    done = await queue.get(job.id)
    assert done is not None
    assert (done.status, done.attempts, done.result) == (SUCCEEDED, 1, {"ok": True})
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.8, calls
    assert await queue.kv.client.zcard(f"{queue.base}waiting-lines") == 0


async def test_a_job_deferred_past_its_expiry_expires_unrun(kv: KeyValueStore, prefix: str) -> None:
    # A deferral keeps the job's expiry: a job whose window never has room expires as any
    # queued job no worker started does, and is not run.
    queue = JobQueue(kv, prefix=prefix, max_attempts=3, result_ttl=600, queued_ttl=1.5)
    calls: list[float] = []

    async def always_defer(job: Job) -> dict[str, Any]:
        calls.append(0.0)
        raise Deferred(0.2)

    job, _ = await queue.submit(make_job("never", max_attempts=1))
    worker = JobWorker(queue, always_defer, trace.NoOpTracer(), consumer="w", poll_seconds=0.2)
    async with running(worker):
        await wait_until(all_finished(queue, [job.id]), within=30, what="the job to expire")
    done = await queue.get(job.id)
    assert done is not None and done.status == FAILED and done.error is not None
    assert done.error["code"] == "job_expired" and done.attempts == 0
    assert len(calls) >= 2, "it was deferred, put back and deferred again before it expired"
    assert await kv.client.exists(f"{queue.base}waiting:k:{job.key_id}") == 0


async def test_a_keys_waiting_jobs_hold_no_entry_run_in_order_and_hold_up_no_other_key(
    queue: JobQueue, kv: KeyValueStore, prefix: str, redis_server
) -> None:
    # A review of the first version (deferred entries left pending, idle, for XAUTOCLAIM to
    # take over): XAUTOCLAIM looks at ten times its count of pending entries from the start,
    # so 30 deferred entries ahead kept a dead worker's job and another key's deferred job from
    # ever being taken over; and a key's jobs that came later ran before its deferred ones.
    settings = make_settings(redis_server.url, "http://127.0.0.1:9")
    # 1,000 tokens a minute over a 6 s window: 100 a window, three of these jobs.
    limits = RateLimiter(kv, LimitConfig(window_seconds=6.0), prefix=prefix)
    answer = Answer()
    runner = Runner([answer], trace.NoOpTracer())
    order: list[str] = []

    async def execute(job: Job) -> dict[str, Any]:
        result = await run_job(settings, runner, job, limits)
        order.append(job.id)
        return result

    limited_key = replace(limited(f"a{prefix}"), tpm=1000)
    other_key = Principal(
        tenant=f"b{prefix}", user="bob", scopes=frozenset({"chat"}), key_id=f"rag-b{prefix}"
    )
    early = [(await queue.submit(job_of(limited_key, n)))[0].id for n in range(5)]
    workers = [
        JobWorker(queue, execute, trace.NoOpTracer(), consumer=f"w{i}", poll_seconds=0.2)
        for i in range(2)
    ]
    line = f"{queue.base}waiting:k:{limited_key.key_id}"
    async with running(*workers):
        # Three fit the window (whichever asked first); the other two wait in the key's line,
        # in the order they came.
        await wait_until(lambda: _count(kv, line, 2), within=30, what="two jobs waiting")
        waiting = await _waiting_ids(kv, line)
        assert waiting == [i for i in early if i in waiting]
        late = (await queue.submit(job_of(limited_key, 5)))[0].id
        others = [(await queue.submit(job_of(other_key, n)))[0].id for n in range(3)]
        await wait_until(lambda: _count(kv, line, 3), within=30, what="the later job waiting")
        await wait_until(all_finished(queue, others), within=30, what="the other key's jobs")
        pending = await kv.client.xpending(queue.stream, "workers")
        assert pending["pending"] == 0, "no waiting job holds a pending entry"
        assert await _waiting_ids(kv, line) == [*waiting, late], "the later job queues behind"
        assert not {*waiting, late} & set(order), "none of them ran meanwhile"
        await wait_until(all_finished(queue, [*early, late]), within=60, what="the key's jobs")
    # Let out in the line's order: the oldest alone, then the next two together once it holds
    # its tokens (those two may finish in either order).
    ran = [i for i in order if i not in others]
    assert set(ran[3:]) == {*waiting, late} and set(ran[:3]) == set(early) - set(waiting)


async def _count(kv: KeyValueStore, key: str, n: int) -> bool:
    return int(await kv.client.zcard(key)) == n


async def _waiting_ids(kv: KeyValueStore, key: str) -> list[str]:
    return [m.decode() for m in await kv.client.zrange(key, 0, -1)]


async def _waiting(queue: JobQueue, job_id: str, calls: list[float]) -> bool:
    """The job was deferred once and is back in the queue: queued, its attempt given back and
    its start forgotten, in its tenant's queued set and its key's waiting line, no entry."""
    if len(calls) != 1:
        return False
    job = await queue.get(job_id)
    if job is None or job.status != QUEUED or job.attempts != 0 or job.started is not None:
        return False
    client = queue.kv.client
    queued = await client.zscore(f"{queue.base}queued:{job.tenant}", job_id)
    waiting = await client.zscore(f"{queue.base}waiting:k:{job.key_id}", job_id)
    pending = await client.xpending(queue.stream, "workers")
    return queued is not None and waiting is not None and pending["pending"] == 0


class Nothing:
    """A path that ends without an answer (a fault the real path cannot be made to show)."""

    spec = StageSpec.of("nothing")

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        return ctx


async def test_a_job_runs_with_its_keys_limits_and_groups_as_they_are_now_and_lets_its_hold_go(
    kv: KeyValueStore, prefix: str, redis_server
) -> None:
    # The review of the first version: the hold used the tpm stored with the job at submit, so
    # `rag keys limits` raising a key's limit left its queued jobs deferred against the old one
    # (and the job read its sources with the groups it had then); and a path that ended
    # without an answer kept its hold for the window.
    settings = make_settings(redis_server.url, "http://127.0.0.1:9")
    limits = RateLimiter(kv, LimitConfig(window_seconds=60), prefix=prefix)
    keys = ApiKeyStore(kv, prefix=f"{prefix}apikey:")
    raw = await keys.create(f"acme-{prefix[:-1]}", "alice", tpm=60, groups=frozenset({"board"}))
    submitted = await keys.resolve(raw)
    assert submitted is not None
    job = job_of(submitted, 0)
    await limits.settle(submitted, 60)  # the key's window is full at its tpm of 60
    with pytest.raises(Deferred):
        await run_job(settings, Runner([Answer()], trace.NoOpTracer()), job, limits, keys)
    await keys.set_limits(raw, rpm=None, tpm=1_000_000)
    await keys.set_groups(raw, frozenset({"staff"}))
    seen: list[Principal] = []

    class Seen(Answer):
        async def __call__(self, ctx: RequestContext) -> RequestContext:
            assert ctx.principal is not None
            seen.append(ctx.principal)
            return await super().__call__(ctx)

    await run_job(settings, Runner([Seen()], trace.NoOpTracer()), job, limits, keys)
    assert [(p.tpm, p.groups) for p in seen] == [(1_000_000, frozenset({"staff"}))]
    # A path without an answer fails the job and lets its 40-token hold go.
    now = await keys.resolve(raw)
    assert now is not None
    before = (await limits.admit(now)).headers()["x-ratelimit-remaining-tokens"]
    with pytest.raises(RuntimeError):
        await run_job(settings, Runner([Nothing()], trace.NoOpTracer()), job, limits, keys)
    after = (await limits.admit(now)).headers()["x-ratelimit-remaining-tokens"]
    assert after == before, "the estimate was let go"
    await keys.revoke(raw)
    with pytest.raises(AuthenticationFailed):
        await run_job(settings, Runner([Answer()], trace.NoOpTracer()), job, limits, keys)
