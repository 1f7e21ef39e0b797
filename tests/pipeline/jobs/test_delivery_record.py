"""A webhook's recorded attempts and its final state agree: the state is written with the
attempts that led to it, and a worker that lost a delivery to another writes neither."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from pipeline.errors import StoreUnavailable
from pipeline.jobs.model import Job
from pipeline.jobs.queue import Delivery, JobQueue
from pipeline.jobs.signing import WebhookSecrets
from pipeline.jobs.urls import UrlPolicy
from pipeline.jobs.webhooks import WebhookSender
from pipeline.jobs.worker import JobWorker
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import make_job, wait_until
from tests.pipeline.jobs.receiver import Receiver
from tests.pipeline.jobs.test_worker import running, worker


def loopback_sender(kv: KeyValueStore, prefix: str, **options: Any) -> WebhookSender:
    options.setdefault("backoff", 0.05)
    return WebhookSender(
        WebhookSecrets(kv, prefix=prefix),
        UrlPolicy(["127.0.0.1/32"]),
        trace.NoOpTracer(),
        timeout=5.0,
        max_attempts=3,
        **options,
    )


async def answer(job: Job) -> dict[str, Any]:
    return {"answer": "ok"}


class ForgetfulQueue(JobQueue):
    """Every write of an attempt fails, as when Redis is away for a moment."""

    async def record_deliveries(
        self, delivery: Delivery, lease: str, deliveries: list[dict[str, Any]]
    ) -> bool:
        raise StoreUnavailable("paused by the test")


async def settled(queue: JobQueue, job_id: str) -> bool:
    job = await queue.get(job_id)
    return job is not None and job.webhook_state in ("delivered", "failed")


async def test_the_settled_state_comes_with_every_attempt_even_when_recording_one_failed(
    kv: KeyValueStore, prefix: str
) -> None:
    queue = ForgetfulQueue(kv, prefix=prefix, max_attempts=3, result_ttl=600)
    sender = loopback_sender(kv, prefix)
    try:
        with Receiver(statuses=[503]) as receiver:
            job, _ = await queue.submit(make_job("hooked", webhook_url=receiver.url))
            async with running(worker(queue, answer, "w", webhooks=sender)):
                await wait_until(lambda: settled(queue, job.id), what="the delivery to settle")
    finally:
        await sender.aclose()
    done = await queue.get(job.id)
    assert done is not None and done.webhook_state == "delivered"
    assert [(d["outcome"], d["status_code"]) for d in done.deliveries] == [
        ("retry", 503),
        ("delivered", 200),
    ]
    assert len(receiver.received) == 2


async def test_a_worker_whose_delivery_was_taken_over_stops_and_writes_nothing_more(
    queue: JobQueue, kv: KeyValueStore, prefix: str
) -> None:
    sender = loopback_sender(kv, prefix, backoff=2.0)  # 1 to 2 s between attempts
    try:
        with Receiver(statuses=[503] * 5) as receiver:
            job, _ = await queue.submit(make_job("hooked", webhook_url=receiver.url))
            first = worker(queue, answer, "w", webhooks=sender)
            async with running(first):

                async def attempted() -> bool:
                    current = await queue.get(job.id)
                    return current is not None and len(current.deliveries) == 1

                await wait_until(attempted, what="the first attempt")
                # Another worker takes the delivery over (its entry went idle): a new lease.
                await kv.client.hset(queue.job_prefix + job.id, "lease", "other-worker:1")
                await wait_until(lambda: _idle(first), what="the first worker to let go")
    finally:
        await sender.aclose()
    current = await queue.get(job.id)
    assert current is not None and current.webhook_state == "pending", "left to the new owner"
    assert [d["outcome"] for d in current.deliveries] == ["retry"], "its later attempt not kept"
    assert len(receiver.received) == 2


async def _idle(first: JobWorker) -> bool:
    return first.delivering == 0
