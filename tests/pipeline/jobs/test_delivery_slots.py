"""Webhook deliveries run outside the workers' job slots, bounded per tenant: a receiver that
drips bytes holds neither the jobs behind it nor another tenant's deliveries."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from pipeline.jobs.model import Job
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.signing import WebhookSecrets
from pipeline.jobs.urls import UrlPolicy
from pipeline.jobs.webhooks import WebhookSender
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import BOB, make_job, wait_until
from tests.pipeline.jobs.receiver import DripReceiver, Receiver
from tests.pipeline.jobs.test_worker import all_finished, running, worker


def slow_sender(kv: KeyValueStore, prefix: str) -> WebhookSender:
    # Each attempt ends at its 2 s deadline; three of them keep a delivery busy for 6 s or more.
    return WebhookSender(
        WebhookSecrets(kv, prefix=prefix),
        UrlPolicy(["127.0.0.1/32"]),
        trace.NoOpTracer(),
        timeout=2.0,
        max_attempts=3,
        backoff=0.05,
    )


async def answer(job: Job) -> dict[str, Any]:
    return {"answer": job.request["messages"][0]["content"]}


async def webhook_state(queue: JobQueue, job_id: str) -> str | None:
    job = await queue.get(job_id)
    return job.webhook_state if job is not None else None


async def test_a_dripping_receiver_does_not_hold_the_job_slot(
    queue: JobQueue, kv: KeyValueStore, prefix: str
) -> None:
    sender = slow_sender(kv, prefix)
    try:
        with DripReceiver() as drip:
            hooked, _ = await queue.submit(make_job("hooked", webhook_url=drip.url))
            plain, _ = await queue.submit(make_job("plain"))
            one_slot = worker(queue, answer, "w", concurrency=1, webhooks=sender)
            async with running(one_slot):
                await wait_until(all_finished(queue, [hooked.id, plain.id]), what="both jobs")
                assert await webhook_state(queue, hooked.id) == "pending", (
                    "the second job ran while the first one's webhook was still being delivered"
                )
                assert one_slot.running == 0 and one_slot.delivering == 1
                await wait_until(
                    lambda: _settled(queue, hooked.id), within=60, what="the delivery to give up"
                )
    finally:
        await sender.aclose()
    done = await queue.get(hooked.id)
    assert done is not None and done.webhook_state == "failed"
    assert [d["outcome"] for d in done.deliveries] == ["retry", "retry", "failed"]
    assert await queue.backlog() == 0


async def _settled(queue: JobQueue, job_id: str) -> bool:
    return await webhook_state(queue, job_id) in ("delivered", "failed")


async def test_one_tenants_slow_receiver_does_not_hold_up_another_tenants_deliveries(
    queue: JobQueue, kv: KeyValueStore, prefix: str
) -> None:
    sender = slow_sender(kv, prefix)
    try:
        with DripReceiver() as drip, Receiver() as fine:
            slow = [
                (await queue.submit(make_job(f"slow {i}", webhook_url=drip.url)))[0].id
                for i in range(3)
            ]
            quick, _ = await queue.submit(make_job("quick", principal=BOB, webhook_url=fine.url))
            busy = worker(
                queue,
                answer,
                "w",
                concurrency=4,
                webhooks=sender,
                webhook_concurrency=2,
                webhook_tenant_concurrency=1,
                stop_grace=0.5,
            )
            async with running(busy):
                await wait_until(
                    lambda: _settled(queue, quick.id), within=20, what="globex's delivery"
                )
                states = [await webhook_state(queue, job_id) for job_id in slow]
                assert states == ["pending"] * 3, "acme's deliveries were still under way"
                assert drip.most_at_once == 1, "at most one of acme's deliveries at a time"
                busy.stop()
    finally:
        await sender.aclose()
    assert len(fine.received) == 1
