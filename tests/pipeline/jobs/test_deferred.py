"""A key's queued jobs hold their estimated tokens as its chat requests do: a job whose key's
token window is full is not run but queued again (its attempt given back, its entry parked
pending), and runs once the window has room, on whichever worker takes it over then."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry import trace

from app.jobs import run_job
from pipeline.context import Completion, Principal, RequestContext
from pipeline.jobs.model import FAILED, QUEUED, SUCCEEDED, Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.worker import Deferred, JobWorker
from pipeline.runner import Runner, StageSpec
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
    assert outcomes.count("finished") == 6 and outcomes.count("deferred") >= 3
    deferred = [
        s for s in exporter.get_finished_spans() if s.attributes.get(attr.JOB_OUTCOME) == "deferred"
    ]
    assert all(0 < s.attributes[attr.JOB_DEFERRED_MS] <= WINDOW_S * 1000 for s in deferred)
    assert await queue.backlog() == 0


async def test_a_deferred_job_is_queued_as_before_it_was_taken_and_runs_after_its_wait(
    queue: JobQueue,
) -> None:
    # The worker's side alone: a job its execute defers is queued again (status, attempt and
    # the tenant's queued set as before it was taken), and is taken over no sooner than its
    # wait, by the worker that deferred it here.
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def defer_once(job: Job) -> dict[str, Any]:
        calls.append(loop.time())
        if len(calls) == 1:
            raise Deferred(0.9)
        return {"ok": True}

    job, _ = await queue.submit(make_job("later", max_attempts=1))
    worker = JobWorker(
        queue,
        defer_once,
        trace.NoOpTracer(),
        consumer="w",
        poll_seconds=0.2,
        visibility_timeout=1.0,
    )
    async with running(worker):
        await wait_until(lambda: _parked(queue, job.id, calls), within=30, what="the deferral")
        await wait_until(all_finished(queue, [job.id]), within=30, what="the job to finish")
    done = await queue.get(job.id)
    assert done is not None
    assert (done.status, done.attempts, done.result) == (SUCCEEDED, 1, {"ok": True})
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.8, calls


async def test_a_job_deferred_past_its_expiry_expires_unrun(kv: KeyValueStore, prefix: str) -> None:
    # A deferral keeps the job's expiry: a job whose window never has room expires as any
    # queued job no worker started does, and is not run.
    queue = JobQueue(kv, prefix=prefix, max_attempts=3, result_ttl=600, queued_ttl=1.5)
    calls: list[float] = []

    async def always_defer(job: Job) -> dict[str, Any]:
        calls.append(0.0)
        raise Deferred(0.2)

    job, _ = await queue.submit(make_job("never", max_attempts=1))
    worker = JobWorker(
        queue,
        always_defer,
        trace.NoOpTracer(),
        consumer="w",
        poll_seconds=0.2,
        visibility_timeout=0.4,
    )
    async with running(worker):
        await wait_until(all_finished(queue, [job.id]), within=30, what="the job to expire")
    done = await queue.get(job.id)
    assert done is not None and done.status == FAILED and done.error is not None
    assert done.error["code"] == "job_expired" and done.attempts == 0
    assert len(calls) >= 2, "it was deferred, taken over and deferred again before it expired"


async def _parked(queue: JobQueue, job_id: str, calls: list[float]) -> bool:
    """The job was deferred once and is back in the queue: queued, its attempt given back, in
    its tenant's queued set."""
    if len(calls) != 1:
        return False
    job = await queue.get(job_id)
    if job is None or job.status != QUEUED or job.attempts != 0:
        return False
    score = await queue.kv.client.zscore(f"{queue.base}queued:{job.tenant}", job_id)
    return score is not None


async def test_deferred_jobs_due_at_once_are_taken_over_batch_after_batch(
    queue: JobQueue,
) -> None:
    # A take-over once every 5 s (min(visibility timeout / 2, 5 s)) took two deferred jobs per
    # period into a worker of two slots: six jobs whose wait was over drained in three periods
    # (10 s from the first batch to the last). A take-over that fills every free slot is now
    # followed by another after one read: the batches follow each other as slots free up.
    runs: dict[str, int] = {}
    finished: list[float] = []
    loop = asyncio.get_running_loop()

    async def defer_first(job: Job) -> dict[str, Any]:
        runs[job.id] = runs.get(job.id, 0) + 1
        if runs[job.id] == 1:
            raise Deferred(0.0)  # due at once: taken over at the next look
        finished.append(loop.time())
        return {"ok": True}

    ids = [(await queue.submit(make_job(f"q{i}", max_attempts=1)))[0].id for i in range(6)]
    worker = JobWorker(
        queue,
        defer_first,
        trace.NoOpTracer(),
        consumer="w",
        concurrency=2,
        poll_seconds=0.2,
        visibility_timeout=60.0,
    )
    async with running(worker):
        await wait_until(all_finished(queue, ids), within=60, what="6 jobs to finish")
    assert runs == dict.fromkeys(ids, 2)
    spread = max(finished) - min(finished)
    assert spread < 5.0, f"the deferred jobs waited a take-over period per batch: {spread:.1f} s"
