"""Jobs: throughput through the whole path with the real vLLM, and the queue's own overhead.

    python -m bench.jobs_bench [--queued 1000] [--llm-url URL] [--llm-jobs 24] [--workers 1 4]

1. Queue overhead (the LLM left out: ``execute`` answers at once), on a private redis-server:
   - submit latency, with 0 to ``--queued`` jobs already waiting;
   - backlog: ``--queued`` jobs waiting, then one worker (concurrency 16) drains them: jobs/s,
     and submit->start per job (mostly time spent waiting in line);
   - trickle: an idle worker, jobs submitted one at a time: submit->start is the queue's own
     latency (stream append, blocking read wake-up, the start script).
2. Jobs per minute through the path (auth, validate, cache lookup, retrieval (skipped: no
   index), generation by vLLM, cache store) at 1 and 4 workers of concurrency 1, distinct
   questions (no cache hits), ``max_tokens`` 16; beside it, as many other questions run through
   the same path directly, as many at a time (what the queue costs on top).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from opentelemetry import trace

from app.jobs import run_job
from app.path import build_paths
from app.services import Services
from app.settings import Settings
from app.stores import job_queue
from pipeline.context import Principal
from pipeline.jobs.model import Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.worker import JobWorker
from pipeline.store.kv import KeyValueStore
from tests.support.servers import RedisServer

# A custom key strong enough for the key store's checks (random, made once per run).
BENCH_KEY = f"rag-bench-{secrets.token_urlsafe(32)}"
PRINCIPAL = Principal("bench", "bench", frozenset({"chat"}), "rag-bench")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(name: str, values_ms: list[float]) -> str:
    return (
        f"{name}: p50 {statistics.median(values_ms):.2f} ms, p99 {pct(values_ms, 0.99):.2f} ms "
        f"(n={len(values_ms)})"
    )


def job(question: str, max_tokens: int = 16, principal: Principal | None = None) -> Job:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return Job.create(principal or PRINCIPAL, body, max_attempts=3)


async def drain(
    queue: JobQueue,
    execute: Callable[[Job], Awaitable[dict[str, Any]]],
    ids: set[str],
    *,
    workers: int,
    concurrency: int,
) -> float:
    """Run workers until every job of ``ids`` has finished; the seconds it took."""
    pool = [
        JobWorker(queue, execute, trace.NoOpTracer(), concurrency=concurrency, poll_seconds=0.2)
        for _ in range(workers)
    ]
    started = time.perf_counter()
    tasks = [asyncio.create_task(w.run()) for w in pool]
    # A finished job's stream entry is deleted: an empty stream means all are done. (Polling
    # every job's record here would load the same event loop the workers run on.)
    while True:
        if await queue.backlog() == 0:
            break
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    for w in pool:
        w.stop()
    await asyncio.gather(*tasks)
    jobs = [await queue.get(i) for i in ids]
    failed = [j for j in jobs if j is not None and j.status != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0].error}")
    return elapsed


async def queue_overhead(queued: int) -> None:
    redis = RedisServer()
    redis.start()
    kv = KeyValueStore.from_url(redis.url, trace.NoOpTracer(), timeout=5.0)
    queue = JobQueue(kv, prefix="bench:")
    await queue.ensure_group()
    starts: dict[str, float] = {}
    arrived = asyncio.Event()

    async def instant(job: Job) -> dict[str, Any]:
        starts[job.id] = time.time()
        arrived.set()
        return {"ok": True}

    try:
        submit_ms, created = [], {}
        for i in range(queued):
            began = time.perf_counter()
            submitted, _ = await queue.submit(job(f"q{i}"))
            submit_ms.append((time.perf_counter() - began) * 1000)
            created[submitted.id] = submitted.created
        print(summary(f"submit latency, 0..{queued} queued", submit_ms))
        elapsed = await drain(queue, instant, set(created), workers=1, concurrency=16)
        waits = [(starts[i] - created[i]) * 1000 for i in created]
        print(
            f"backlog of {queued}: drained by 1 worker (concurrency 16) in {elapsed:.2f} s = "
            f"{queued / elapsed:.0f} jobs/s, {elapsed * 1000 / queued:.2f} ms per job"
        )
        print(summary("  submit->start while in line", waits))
        arrived.clear()
        await trickle(queue, instant, starts, arrived, queued)
    finally:
        await kv.aclose()
        redis.stop()


async def trickle(
    queue: JobQueue,
    execute: Callable[[Job], Awaitable[dict[str, Any]]],
    starts: dict[str, float],
    arrived: asyncio.Event,
    count: int,
) -> None:
    worker = JobWorker(queue, execute, trace.NoOpTracer(), concurrency=16, poll_seconds=1.0)
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(0.3)
    latencies, submit_ms = [], []
    for i in range(count):
        began = time.perf_counter()
        submitted, _ = await queue.submit(job(f"t{i}"))
        submit_ms.append((time.perf_counter() - began) * 1000)
        await arrived.wait()
        arrived.clear()
        latencies.append((starts[submitted.id] - submitted.created) * 1000)
    worker.stop()
    await task
    print(summary(f"trickle ({count} jobs, idle worker): submit latency", submit_ms))
    print(summary("  submit->start (queue overhead)", latencies))


async def without_queue(
    execute: Callable[[Job], Awaitable[dict[str, Any]]],
    questions: list[str],
    concurrency: int,
    principal: Principal | None = None,
) -> float:
    """The same path run directly (as the chat route runs it), ``concurrency`` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(question: str) -> None:
        async with limit:
            await execute(job(question, principal=principal))

    started = time.perf_counter()
    await asyncio.gather(*(one(q) for q in questions))
    return time.perf_counter() - started


async def llm_throughput(llm_url: str, count: int, worker_counts: list[int]) -> None:
    redis = RedisServer()
    redis.start()
    settings = Settings(
        environment="test",
        redis={"url": redis.url, "key_prefix": "bench:"},
        llm={"base_url": llm_url},
        retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-bench-"), "warm_up": False},
        jobs={"workers": 0},
    )
    services = Services.build(settings, trace.NoOpTracer())
    queue = job_queue(settings, services.kv)
    chat = build_paths(settings, services).chat

    async def execute(job: Job) -> dict[str, Any]:
        return await run_job(settings, chat, job)

    try:
        await services.keys.create("bench", "bench", frozenset({"chat"}), raw_key=BENCH_KEY)
        owner = await services.keys.resolve(BENCH_KEY)
        assert owner is not None
        await queue.ensure_group()
        for workers in worker_counts:
            tag = uuid.uuid4().hex[:6]
            questions = [f"In a few words, what is {i} + {i}? ({tag})" for i in range(count)]
            ids = {(await queue.submit(job(q, principal=owner)))[0].id for q in questions}
            elapsed = await drain(queue, execute, ids, workers=workers, concurrency=1)
            direct = [f"In a few words, what is {i} + {i}? ({tag}, direct)" for i in range(count)]
            base = await without_queue(execute, direct, workers, owner)
            print(
                f"{workers} worker(s): {count} jobs in {elapsed:.1f} s = "
                f"{count * 60 / elapsed:.1f} jobs/min; the same path without the queue, "
                f"{workers} at a time: {count * 60 / base:.1f} per min; ratio {base / elapsed:.2f}"
            )
    finally:
        await services.aclose()
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--llm-url", help="a running vLLM (skip the LLM part when absent)")
    parser.add_argument("--llm-jobs", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    if args.llm_url:
        try:
            healthy = httpx.get(f"{args.llm_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if not healthy:
            raise SystemExit(
                f"no vLLM answers at {args.llm_url}: start one (`make run`, or "
                "`bash scripts/start-vllm.sh PORT`) or give --llm-url"
            )
    asyncio.run(run(args))


async def run(args: argparse.Namespace) -> None:
    await queue_overhead(args.queued)
    if args.llm_url:
        await llm_throughput(args.llm_url, args.llm_jobs, args.workers)


if __name__ == "__main__":
    main()
