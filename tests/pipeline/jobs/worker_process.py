"""A job worker in a process of its own, with a counting ``execute``, for the job tests.

    python -m tests.pipeline.jobs.worker_process REDIS_URL PREFIX CONSUMER DELAY_SECONDS

Each run of a job adds 1 to ``{prefix}counts[job id]`` and names the consumer in
``{prefix}runner[job id]`` before it sleeps ``DELAY_SECONDS`` and answers ``{"job", "by"}``.
It sets ``{prefix}ready:{consumer}`` once it reads the queue; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

from opentelemetry import trace

from pipeline.jobs.model import Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.worker import Execute, JobWorker
from pipeline.store.kv import KeyValueStore


def counting_execute(kv: KeyValueStore, prefix: str, consumer: str, delay: float) -> Execute:
    async def execute(job: Job) -> dict[str, Any]:
        await kv.client.hincrby(f"{prefix}counts", job.id, 1)
        await kv.client.hset(f"{prefix}runner", job.id, consumer)
        await asyncio.sleep(delay)
        return {"job": job.id, "by": consumer}

    return execute


async def main(url: str, prefix: str, consumer: str, delay: float) -> None:
    kv = KeyValueStore.from_url(url, trace.NoOpTracer(), timeout=5.0)
    queue = JobQueue(kv, prefix=prefix, max_attempts=3)
    worker = JobWorker(
        queue,
        counting_execute(kv, prefix, consumer, delay),
        trace.NoOpTracer(),
        consumer=consumer,
        concurrency=2,
        # The in-process workers beside it keep the 30 s default (a heartbeat every 10 s): a
        # shorter one here would take back a job of theirs that a loaded machine held over it,
        # and run it twice. A killed process's job is taken back by an in-process survivor.
        visibility_timeout=30.0,
        poll_seconds=0.2,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    await queue.ensure_group()
    await kv.set(f"{prefix}ready:{consumer}", b"1")
    await worker.run()
    await kv.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
