"""The worker: one consumer of the job stream, running at most ``concurrency`` jobs at once.

Its loop reads new entries (a blocking ``XREADGROUP``) for as many jobs as it has free slots,
and every few seconds takes over entries that another worker left silent for the visibility
timeout (``XAUTOCLAIM``): that worker died. While a job runs, a heartbeat resets its entry's
idle time, so a long job is not taken over from a live worker. A transient failure (a 5xx
error) queues the job again after a backoff, up to ``max_attempts`` runs; then, or for any other
error, the job fails with the reason. ``stop()`` stops reading and lets running jobs finish for
``stop_grace`` seconds; jobs still running then are handed back to the queue.

Each job runs in its own trace (span ``process jobs``, kind consumer), linked to the trace of
the request that submitted it, with the job id as an attribute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.semconv._incubating.attributes import messaging_attributes as messaging
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from pipeline import attributes as attr
from pipeline.errors import PipelineError
from pipeline.jobs.model import FAILED, SUCCEEDED, Job
from pipeline.jobs.queue import Delivery, JobQueue
from pipeline.jobs.webhooks import WebhookSender
from pipeline.kv import StoreUnavailable

log = logging.getLogger("rag.jobs")

Execute = Callable[[Job], Awaitable[dict[str, Any]]]

INTERNAL_ERROR = {
    "message": "The job failed with an internal error.",
    "type": "api_error",
    "param": None,
    "code": "internal_error",
}


OUTCOMES = {0: "lease lost", 1: "finished", 2: "finished, webhook owed"}


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class JobWorker:
    """Runs jobs from ``queue`` with ``execute(job) -> result``; ``run()`` until ``stop()``."""

    def __init__(
        self,
        queue: JobQueue,
        execute: Execute,
        tracer: trace.Tracer,
        *,
        consumer: str | None = None,
        concurrency: int = 2,
        visibility_timeout: float = 30.0,
        poll_seconds: float = 1.0,
        retry_backoff: float = 1.0,
        stop_grace: float = 30.0,
        webhooks: WebhookSender | None = None,
    ) -> None:
        self.queue = queue
        self.execute = execute
        self.tracer = tracer
        self.consumer = consumer or default_consumer()
        self.concurrency = concurrency
        self.visibility_timeout = visibility_timeout
        self.poll_seconds = poll_seconds
        self.retry_backoff = retry_backoff
        self.stop_grace = stop_grace
        self.webhooks = webhooks
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()

    def stop(self) -> None:
        """Stop taking jobs; ``run()`` returns once the running ones are done or handed back."""
        self._stopping.set()

    @property
    def running(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        await self._until_stopped(self.queue.ensure_group)
        heartbeat = asyncio.create_task(self._heartbeat())
        loop = asyncio.get_running_loop()
        next_reclaim = 0.0
        try:
            while not self._stopping.is_set():
                self._slot_freed.clear()
                free = self.concurrency - len(self._running)
                if free <= 0:
                    await self._first(self._slot_freed.wait())
                    continue
                try:
                    deliveries: list[Delivery] = []
                    if loop.time() >= next_reclaim:
                        next_reclaim = loop.time() + min(self.visibility_timeout / 2, 5.0)
                        deliveries = await self.queue.reclaim(
                            self.consumer,
                            min_idle_ms=int(self.visibility_timeout * 1000),
                            count=free,
                        )
                    if not deliveries:
                        deliveries = await self._read_unless_stopped(free)
                except StoreUnavailable as exc:
                    log.warning("job queue unreachable (%s); retrying", exc)
                    await self._first(asyncio.sleep(self.poll_seconds))
                    continue
                for delivery in deliveries:
                    self._spawn(delivery)
        finally:
            heartbeat.cancel()
            await self._drain()

    async def _first(self, awaitable: Awaitable[Any]) -> None:
        """Wait for ``awaitable`` or for ``stop()``, whichever comes first."""
        waiters = {asyncio.ensure_future(awaitable), asyncio.ensure_future(self._stopping.wait())}
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            waiter.cancel()

    async def _read_unless_stopped(self, count: int) -> list[Delivery]:
        """New entries; a ``stop()`` during the blocking read cuts it short. (Entries Redis
        handed over in that very moment stay pending and are taken over after the visibility
        timeout: late, never lost.)"""
        read = asyncio.ensure_future(
            self.queue.read(self.consumer, count=count, block_ms=int(self.poll_seconds * 1000))
        )
        stopped = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if read.done():
            return read.result()
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
            await read
        return []

    async def _until_stopped(self, call: Callable[[], Awaitable[Any]]) -> None:
        while not self._stopping.is_set():
            try:
                await call()
                return
            except StoreUnavailable as exc:
                log.warning("job queue unreachable (%s); retrying", exc)
                await self._first(asyncio.sleep(self.poll_seconds))

    def _spawn(self, delivery: Delivery) -> None:
        if delivery.entry in self._running:  # our own entry, reclaimed while we still run it
            return
        task = asyncio.create_task(self._handle(delivery))
        self._running[delivery.entry] = task

        def done(_: asyncio.Task[None]) -> None:
            self._running.pop(delivery.entry, None)
            self._slot_freed.set()

        task.add_done_callback(done)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.visibility_timeout / 3)
            try:
                await self.queue.touch(self.consumer, list(self._running))
            except StoreUnavailable as exc:
                log.warning("job heartbeat failed: %s", exc)

    async def _drain(self) -> None:
        if not self._running:
            return
        tasks = list(self._running.values())
        _, late = await asyncio.wait(tasks, timeout=self.stop_grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _handle(self, delivery: Delivery) -> None:
        lease = f"{self.consumer}:{secrets.token_hex(4)}"
        try:
            kind, attempt = await self.queue.start(delivery, lease)
            if kind not in ("run", "exhausted", "deliver"):
                return  # cancelled, finished or expired: acknowledged by start
            job = await self.queue.get(delivery.job_id)
        except StoreUnavailable as exc:
            # Left pending: taken over after the visibility timeout.
            log.warning("job %s not started: %s", delivery.job_id, exc)
            return
        if job is None:
            return
        with self.tracer.start_as_current_span(
            "process jobs",
            context=otel_context.Context(),  # a trace of its own, linked to the submitter's
            kind=SpanKind.CONSUMER,
            links=_links(job.traceparent),
            attributes={
                messaging.MESSAGING_SYSTEM: "redis",
                messaging.MESSAGING_OPERATION_TYPE: "process",
                messaging.MESSAGING_DESTINATION_NAME: self.queue.stream,
                messaging.MESSAGING_CONSUMER_GROUP_NAME: "workers",
                messaging.MESSAGING_MESSAGE_ID: delivery.entry,
                attr.JOB_ID: job.id,
                attr.JOB_ATTEMPT: attempt,
                attr.TENANT: job.tenant,
            },
        ) as span:
            try:
                await self._advance(kind, job, delivery, lease, span)
            except StoreUnavailable as exc:
                span.set_status(Status(StatusCode.ERROR, "StoreUnavailable"))
                log.warning("job %s: could not record its state: %s", job.id, exc)

    async def _advance(
        self, kind: str, job: Job, delivery: Delivery, lease: str, span: trace.Span
    ) -> None:
        if kind == "run":
            outcome = await self._run(job, delivery, lease)
        elif kind == "exhausted":
            outcome = await self.queue.finish(delivery, lease, FAILED, _abandoned(job))
        else:
            outcome = 2  # finished before; its webhook is still owed
        span.set_attribute(attr.JOB_OUTCOME, OUTCOMES.get(outcome, "requeued"))
        if outcome == 2:
            await self._deliver(delivery, lease)

    async def _run(self, job: Job, delivery: Delivery, lease: str) -> int:
        """Execute the job; the FINISH outcome (0, 1, 2), or -1 when it was queued again."""
        try:
            result = await self.execute(job)
        except asyncio.CancelledError:
            await asyncio.shield(self.queue.requeue(delivery, lease, None, refund=True))
            raise
        except PipelineError as exc:
            error = exc.to_dict()["error"]
            transient = exc.status_code >= 500
        except Exception:
            log.exception("job %s failed", job.id)
            error, transient = dict(INTERNAL_ERROR), True
        else:
            return await self.queue.finish(delivery, lease, SUCCEEDED, result)
        trace.get_current_span().set_status(Status(StatusCode.ERROR, str(error.get("code"))))
        if transient and job.attempts < job.max_attempts:
            await asyncio.sleep(self.retry_backoff * 2 ** (job.attempts - 1))
            await self.queue.requeue(delivery, lease, error, refund=False)
            return -1
        return await self.queue.finish(delivery, lease, FAILED, error)

    async def _deliver(self, delivery: Delivery, lease: str) -> None:
        job = await self.queue.get(delivery.job_id)
        if job is None:
            return
        if self.webhooks is None:
            log.error("job %s has a webhook but this worker cannot deliver it", job.id)
            await self.queue.settle_webhook(delivery, lease, "failed")
            return

        async def record(deliveries: list[dict[str, Any]]) -> None:
            try:
                await self.queue.record_deliveries(job.id, deliveries)
            except StoreUnavailable as exc:
                log.warning("job %s: delivery attempt not recorded: %s", job.id, exc)

        delivered = await self.webhooks.deliver(job, record)
        await self.queue.settle_webhook(delivery, lease, "delivered" if delivered else "failed")


def _links(traceparent: str | None) -> list[Link]:
    if not traceparent:
        return []
    parent = trace.get_current_span(extract({"traceparent": traceparent})).get_span_context()
    return [Link(parent)] if parent.is_valid else []


def _abandoned(job: Job) -> dict[str, Any]:
    reason = (
        f" Last error: {job.last_error.get('message')}"
        if job.last_error and job.last_error.get("message")
        else ""
    )
    return {
        "message": f"The job was started {job.attempts} times without finishing (its worker "
        f"stopped responding); it is not retried.{reason}",
        "type": "api_error",
        "param": None,
        "code": "job_abandoned",
    }
