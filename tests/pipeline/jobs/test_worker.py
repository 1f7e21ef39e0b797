"""Workers against a real Redis: each job done once, a killed worker's job taken over, retries,
cancel, graceful stop, Redis trouble while writing a result, and the job's span."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pipeline.errors import InvalidRequest, ServiceUnavailable, StoreUnavailable
from pipeline.jobs.model import CANCELLED, FAILED, QUEUED, SUCCEEDED, Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.worker import Execute, JobWorker
from pipeline.looptime import LoopLag
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry import attributes as attr
from tests.pipeline.jobs.conftest import make_job, wait_until
from tests.pipeline.jobs.worker_process import counting_execute
from tests.support.servers import ROOT
from tests.support.tracing import memory_tracing


@asynccontextmanager
async def running(*workers: JobWorker) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*tasks)


def worker(queue: JobQueue, execute: Execute, name: str, **options: Any) -> JobWorker:
    options.setdefault("poll_seconds", 0.2)
    options.setdefault("retry_backoff", 0.01)
    return JobWorker(queue, execute, trace.NoOpTracer(), consumer=name, **options)


def all_finished(queue: JobQueue, ids: list[str]) -> Callable[[], Any]:
    async def check() -> bool:
        try:
            jobs = [await queue.get(i) for i in ids]
        except StoreUnavailable:  # Redis paused by the test
            return False
        return all(j is not None and j.status in (SUCCEEDED, FAILED, CANCELLED) for j in jobs)

    return check


def start_process(
    redis_url: str, prefix: str, consumer: str, delay: float
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.pipeline.jobs.worker_process",
            redis_url,
            prefix,
            consumer,
            str(delay),
        ],
        cwd=ROOT,
    )


async def test_a_worker_runs_a_job_and_stores_its_result(queue: JobQueue) -> None:
    fine: list[bool] = []

    async def echo(job: Job) -> dict[str, Any]:
        fine.append(LoopLag.of(asyncio.get_running_loop()).fine)  # a stall in it shows finely
        return {"echo": job.request["messages"][0]["content"]}

    job, _ = await queue.submit(make_job("ping"))
    async with running(worker(queue, echo, "w1")):
        await wait_until(all_finished(queue, [job.id]), what="the job to finish")
    done = await queue.get(job.id)
    assert done is not None
    assert (done.status, done.result, done.attempts) == (SUCCEEDED, {"echo": "ping"}, 1)
    assert done.started is not None and done.finished is not None
    assert done.created <= done.started <= done.finished
    assert await queue.backlog() == 0
    assert fine == [True]


async def test_forty_jobs_over_three_workers_and_a_process_each_run_exactly_once(
    queue: JobQueue, kv: KeyValueStore, prefix: str, redis_server
) -> None:
    process = start_process(redis_server.url, prefix, "proc", 0.05)
    try:
        await wait_until(lambda: _ready_as(kv, prefix, "proc"), what="the worker process to start")
        ids = [(await queue.submit(make_job(f"q{i}")))[0].id for i in range(40)]
        workers = [
            worker(queue, counting_execute(kv, prefix, f"task{i}", 0.05), f"task{i}")
            for i in range(3)
        ]
        async with running(*workers):
            await wait_until(all_finished(queue, ids), what="40 jobs to finish")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, "SIGTERM stops the worker process gracefully"
    counts = {k.decode(): int(v) for k, v in (await kv.hgetall(f"{prefix}counts")).items()}
    assert counts == dict.fromkeys(ids, 1), "every job ran once, none twice"
    jobs = [await queue.get(i) for i in ids]
    assert all(j is not None and j.status == SUCCEEDED for j in jobs)
    assert all(j is not None and j.result == {"job": j.id, "by": j.result["by"]} for j in jobs)
    by = {j.result["by"] for j in jobs if j is not None and j.result}
    assert "proc" in by and len(by) >= 3, f"the work was shared: {by}"
    assert await queue.backlog() == 0


async def test_a_killed_worker_process_job_is_finished_by_another(
    queue: JobQueue, kv: KeyValueStore, prefix: str, redis_server
) -> None:
    process = start_process(redis_server.url, prefix, "doomed", 3600)
    try:
        await wait_until(lambda: _ready_as(kv, prefix, "doomed"), what="the process to start")
        job, _ = await queue.submit(make_job("long"))

        async def taken_by_process() -> bool:
            return await kv.client.hget(f"{prefix}runner", job.id) == b"doomed"

        await wait_until(taken_by_process, what="the process to start the job")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    running_job = await queue.get(job.id)
    assert running_job is not None and running_job.status == "running"
    survivor = worker(
        queue, counting_execute(kv, prefix, "survivor", 0.0), "survivor", visibility_timeout=1.0
    )
    async with running(survivor):
        await wait_until(all_finished(queue, [job.id]), what="the survivor to finish the job")
    done = await queue.get(job.id)
    assert done is not None
    assert (done.status, done.attempts) == (SUCCEEDED, 2)
    assert done.result == {"job": job.id, "by": "survivor"}
    assert await queue.backlog() == 0


async def _ready_as(kv: KeyValueStore, prefix: str, consumer: str) -> bool:
    return await kv.get(f"{prefix}ready:{consumer}") is not None


async def test_a_cancelled_job_is_never_run(
    queue: JobQueue, kv: KeyValueStore, prefix: str
) -> None:
    keep, _ = await queue.submit(make_job("keep"))
    drop, _ = await queue.submit(make_job("drop"))
    assert await queue.cancel("acme", drop.id) == CANCELLED
    async with running(worker(queue, counting_execute(kv, prefix, "w", 0), "w")):
        await wait_until(all_finished(queue, [keep.id]), what="the kept job")
        await wait_until(lambda: _empty(queue), what="the stream to drain")
    counts = await kv.hgetall(f"{prefix}counts")
    assert counts == {keep.id.encode(): b"1"}
    dropped = await queue.get(drop.id)
    assert dropped is not None and dropped.status == CANCELLED and dropped.result is None


async def _empty(queue: JobQueue) -> bool:
    return await queue.backlog() == 0


async def test_transient_errors_are_retried_then_the_job_fails_with_the_reason(
    queue: JobQueue,
) -> None:
    calls: dict[str, int] = {}

    async def flaky(job: Job) -> dict[str, Any]:
        calls[job.id] = calls.get(job.id, 0) + 1
        if job.request["messages"][0]["content"] == "bad":
            raise InvalidRequest("max_tokens too large", param="max_tokens")
        raise ServiceUnavailable("vLLM cannot be reached", code="llm_unavailable")

    down, _ = await queue.submit(make_job("down", max_attempts=3))
    bad, _ = await queue.submit(make_job("bad", max_attempts=3))
    async with running(worker(queue, flaky, "w")):
        await wait_until(all_finished(queue, [down.id, bad.id]), what="both jobs to fail")
    failed_down, failed_bad = await queue.get(down.id), await queue.get(bad.id)
    assert failed_down is not None and failed_bad is not None
    assert (failed_down.status, failed_down.attempts, calls[down.id]) == (FAILED, 3, 3)
    assert failed_down.error is not None
    assert failed_down.error["type"] == "service_unavailable"
    assert failed_down.error["code"] == "llm_unavailable"
    assert (failed_bad.status, failed_bad.attempts, calls[bad.id]) == (FAILED, 1, 1)
    assert failed_bad.error is not None and failed_bad.error["param"] == "max_tokens"


async def test_stopping_mid_job_hands_it_back_to_the_queue(queue: JobQueue) -> None:
    started = asyncio.Event()

    async def slow(job: Job) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(3600)
        return {}

    job, _ = await queue.submit(make_job())
    leaving = worker(queue, slow, "leaving", stop_grace=0.1)
    async with running(leaving):
        await asyncio.wait_for(started.wait(), 30)
    back = await queue.get(job.id)
    assert back is not None and (back.status, back.attempts) == (QUEUED, 0)

    async def quick(job: Job) -> dict[str, Any]:
        return {"ok": True}

    async with running(worker(queue, quick, "next")):
        await wait_until(all_finished(queue, [job.id]), what="the next worker")
    done = await queue.get(job.id)
    assert done is not None and (done.status, done.attempts) == (SUCCEEDED, 1)


async def test_a_result_write_is_retried_while_redis_is_paused(redis_server, prefix: str) -> None:
    kv = KeyValueStore.from_url(redis_server.url, trace.NoOpTracer(), timeout=0.5)
    queue = JobQueue(kv, prefix=prefix, max_attempts=3, result_ttl=600)

    async def pausing(job: Job) -> dict[str, Any]:
        # Redis stops taking writes for 1.5 s, longer than the client's 0.5 s timeout.
        await kv.client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        return {"written": "after the pause"}

    try:
        job, _ = await queue.submit(make_job())
        async with running(worker(queue, pausing, "w")):
            await wait_until(all_finished(queue, [job.id]), within=60, what="the result")
        done = await queue.get(job.id)
    finally:
        await kv.aclose()
    assert done is not None
    assert (done.status, done.result, done.attempts) == (
        SUCCEEDED,
        {"written": "after the pause"},
        1,
    )


async def test_the_job_span_carries_the_job_id_and_links_to_the_submitter(
    queue: JobQueue,
) -> None:
    provider, exporter = memory_tracing()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("POST /v1/jobs") as submit:
        submitter = submit.get_span_context()
        traceparent = f"00-{submitter.trace_id:032x}-{submitter.span_id:016x}-01"
    job, _ = await queue.submit(make_job(traceparent=traceparent))

    async def inner(job: Job) -> dict[str, Any]:
        with tracer.start_as_current_span("stage generate"):
            return {"ok": True}

    traced = JobWorker(queue, inner, tracer, consumer="traced", poll_seconds=0.2)
    async with running(traced):
        await wait_until(all_finished(queue, [job.id]), what="the job")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    process = spans["process jobs"]
    assert process.kind == SpanKind.CONSUMER
    assert process.attributes is not None and process.attributes[attr.JOB_ID] == job.id
    assert process.parent is None, "a job is a trace of its own"
    assert process.context.trace_id != submitter.trace_id
    assert [link.context.trace_id for link in process.links] == [submitter.trace_id]
    assert [link.context.span_id for link in process.links] == [submitter.span_id]
    child = spans["stage generate"]
    assert child.parent is not None and child.parent.span_id == process.context.span_id
