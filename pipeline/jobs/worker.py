"""The worker: one consumer of the job stream, running at most ``concurrency`` jobs at once.

Its loop reads new entries (a blocking ``XREADGROUP``) for as many jobs as it has free slots,
and every few seconds takes over entries that another worker left silent for the visibility
timeout (``XAUTOCLAIM``): that worker died. Each pass it also puts back in the stream the jobs
whose wait is over (``JobQueue.promote``): a job ``execute`` deferred (``Deferred``: its key's
token window was full) waits outside the stream, in its key's waiting line. While a job runs,
a heartbeat resets its entry's idle time, so a long job is not taken over from a live worker.
A transient failure (a 5xx error) queues the job again after a backoff, up to ``max_attempts``
runs; then, or for any other error, the job fails with the reason. ``stop()`` stops reading and
lets running jobs finish for ``stop_grace`` seconds; jobs still running then are handed back to
the queue. Every ``sweep_seconds`` it also fails queued jobs past their expiry
(``JobQueue.sweep``).

Webhooks are delivered outside the job slots: a finished job frees its slot at once and its
delivery joins the worker's deliveries, at most ``webhook_concurrency`` at a time and at most
``webhook_tenant_concurrency`` of one tenant's. A slot is what runs the model, a delivery only
waits on a receiver; a receiver that is slow (or hostile: one byte a second) must not stop the
worker from running jobs, nor one tenant's receiver hold up the others' deliveries. Each attempt
has an overall deadline (``WebhookSender``), so every delivery ends. The heartbeat covers the
entries of deliveries too, and a worker with ``delivery_backlog`` deliveries waiting takes no
new jobs until some are done.

What it reads back from Redis may have been written by another version, or damaged: a job whose
record cannot be read fails at once (``job_unreadable``, its webhook unsent), acknowledged, rather
than being taken over and met again after every visibility timeout; and an unexpected error in
the loop is logged and retried after a pause, so that neither kills the worker.

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
from contextvars import ContextVar
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.semconv._incubating.attributes import messaging_attributes as messaging
from opentelemetry.trace import Link, SpanKind

from pipeline.errors import PipelineError, StoreUnavailable
from pipeline.jobs.model import FAILED, SUCCEEDED, Job, JobUnreadable
from pipeline.jobs.queue import Delivery, JobQueue
from pipeline.jobs.webhooks import WebhookSender, ended, unsent, webhook_state
from pipeline.looptime import Serving
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import mark_failed

log = logging.getLogger("rag.jobs")

Execute = Callable[[Job], Awaitable[dict[str, Any]]]

INTERNAL_ERROR = {
    "message": "The job failed with an internal error.",
    "type": "api_error",
    "param": None,
    "code": "internal_error",
}


UNREADABLE_ERROR = {
    "message": "The job's stored record could not be read (damaged, or written by another "
    "version of the service); it was not run. Submit it again.",
    "type": "api_error",
    "param": None,
    "code": "job_unreadable",
}

OUTCOMES = {-2: "deferred", 0: "lease lost", 1: "finished", 2: "finished, webhook owed"}
# After an unexpected error in the loop: long enough that a fault met on every pass cannot spin
# (nor flood the log), short enough that the worker is soon back.
LOOP_ERROR_PAUSE = 1.0


class Deferred(Exception):
    """Raised by ``execute`` for a job that may not run yet (its key's token window is full):
    the job is queued again, its attempt given back, at its place in its key's waiting line,
    and runs once ``retry_after`` seconds have passed (``JobQueue.park``)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"deferred for {retry_after:.3f} s")
        self.retry_after = max(0.0, retry_after)


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
        sweep_seconds: float = 10.0,
        webhook_concurrency: int = 8,
        webhook_tenant_concurrency: int = 2,
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
        self.sweep_seconds = sweep_seconds
        self.delivery_backlog = 16 * webhook_concurrency
        self._running: dict[str, asyncio.Task[None]] = {}
        self._delivering: dict[str, asyncio.Task[None]] = {}
        self._delivery_slots = asyncio.Semaphore(webhook_concurrency)
        self._tenant_slots: dict[str, asyncio.Semaphore] = {}
        self._tenant_deliveries: dict[str, int] = {}
        self._tenant_concurrency = webhook_tenant_concurrency
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()

    def stop(self) -> None:
        """Stop taking jobs; ``run()`` returns once the running ones are done or handed back."""
        self._stopping.set()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def delivering(self) -> int:
        return len(self._delivering)

    async def run(self) -> None:
        await self._until_stopped(self.queue.ensure_group)
        heartbeat = asyncio.create_task(self._heartbeat())
        loop = asyncio.get_running_loop()
        next_reclaim = next_sweep = 0.0
        try:
            while not self._stopping.is_set():
                self._slot_freed.clear()
                free = self.concurrency - len(self._running)
                if free <= 0 or len(self._delivering) >= self.delivery_backlog:
                    await self._first(self._slot_freed.wait())
                    continue
                try:
                    if loop.time() >= next_sweep:
                        next_sweep = loop.time() + self.sweep_seconds
                        await self._sweep()
                    await self._promote(free)
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
                except Exception:
                    # A fault (or a value from Redis no check foresaw) must not end the task:
                    # nothing would restart it, and this replica would run no job again.
                    log.exception("job worker %s: unexpected error; going on", self.consumer)
                    await self._first(asyncio.sleep(max(self.poll_seconds, LOOP_ERROR_PAUSE)))
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

    async def _sweep(self) -> None:
        expired, dropped = await self.queue.sweep()
        if expired or dropped:
            log.warning("job sweep: %d queued jobs expired, %d lost to the cap", expired, dropped)

    def _spawn(self, delivery: Delivery) -> None:
        if delivery.entry in self._running or delivery.entry in self._delivering:
            return  # our own entry, reclaimed while we still work on it
        task = asyncio.create_task(self._handle(delivery))
        self._running[delivery.entry] = task

        def done(_: asyncio.Task[None]) -> None:
            self._running.pop(delivery.entry, None)
            self._slot_freed.set()
            _log_fault(task, delivery)

        task.add_done_callback(done)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.visibility_timeout / 3)
            try:
                await self.queue.touch(self.consumer, [*self._running, *self._delivering])
            except StoreUnavailable as exc:
                log.warning("job heartbeat failed: %s", exc)

    async def _drain(self) -> None:
        """Running jobs and deliveries get ``stop_grace`` to finish. A delivery cut short leaves
        its entry pending: another worker takes it over and resumes the attempts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.stop_grace
        for group in (self._running, self._delivering):  # jobs first: they hand over deliveries
            tasks = list(group.values())
            if not tasks:
                continue
            _, late = await asyncio.wait(tasks, timeout=max(0.0, end - loop.time()))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _handle(self, delivery: Delivery) -> None:
        lease = f"{self.consumer}:{secrets.token_hex(4)}"
        line = ""
        try:
            kind, attempt, line = await self.queue.start(delivery, lease)
            if kind not in ("run", "exhausted", "deliver"):
                return  # cancelled, finished, expired or settled: acknowledged by start
            job = await self.queue.get(delivery.job_id)
        except JobUnreadable:
            await _Admission(self, line).release()
            await self._fail_unreadable(delivery, lease, kind)
            return
        except StoreUnavailable as exc:
            # Left pending: taken over after the visibility timeout.
            log.warning("job %s not started: %s", delivery.job_id, exc)
            return
        if job is None:
            await _Admission(self, line).release()
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
                await self._advance(kind, job, delivery, lease, span, line)
            except StoreUnavailable as exc:
                mark_failed(span, exc)
                log.warning("job %s: could not record its state: %s", job.id, exc)

    async def _fail_unreadable(self, delivery: Delivery, lease: str, kind: str) -> None:
        """Fail, under the lease ``start`` gave, the job whose record cannot be read (the queue
        logged why), with its webhook unsent: nothing could run it, nor say what to deliver."""
        log.error("job %s failed: its record cannot be read", delivery.job_id)
        try:
            if kind != "deliver":
                error = dict(UNREADABLE_ERROR)
                if await self.queue.finish(delivery, lease, FAILED, error) != 2:
                    return
            await self._settle_unsent(delivery, lease)
        except StoreUnavailable as exc:
            log.warning("job %s: could not record its failure: %s", delivery.job_id, exc)

    async def _settle_unsent(self, delivery: Delivery, lease: str) -> None:
        unsendable = unsent(1, "the job's stored record could not be read")
        await self.queue.settle_webhook(delivery, lease, FAILED, [unsendable])

    async def _advance(
        self, kind: str, job: Job, delivery: Delivery, lease: str, span: trace.Span, line: str
    ) -> None:
        if kind == "run":
            outcome = await self._run(job, delivery, lease, _Admission(self, line))
        elif kind == "exhausted":
            outcome = await self.queue.finish(delivery, lease, FAILED, _abandoned(job))
        else:
            outcome = 2  # finished before; its webhook is still owed
        span.set_attribute(attr.JOB_OUTCOME, OUTCOMES.get(outcome, "requeued"))
        if outcome == 2:
            self._hand_over(job.tenant, delivery, lease)

    def _hand_over(self, tenant: str, delivery: Delivery, lease: str) -> None:
        """The webhook of a finished job, delivered outside its slot (see the module doc)."""
        task = asyncio.create_task(self._bounded_delivery(tenant, delivery, lease))
        self._delivering[delivery.entry] = task

        def done(_: asyncio.Task[None]) -> None:
            self._delivering.pop(delivery.entry, None)
            self._slot_freed.set()
            _log_fault(task, delivery)

        task.add_done_callback(done)

    async def _bounded_delivery(self, tenant: str, delivery: Delivery, lease: str) -> None:
        slots = self._tenant_slots.get(tenant)
        if slots is None:
            slots = self._tenant_slots[tenant] = asyncio.Semaphore(self._tenant_concurrency)
        self._tenant_deliveries[tenant] = self._tenant_deliveries.get(tenant, 0) + 1
        try:
            async with slots, self._delivery_slots:
                await self._deliver(delivery, lease)
        except StoreUnavailable as exc:
            log.warning("job %s: webhook state not recorded: %s", delivery.job_id, exc)
        finally:
            self._tenant_deliveries[tenant] -= 1
            if not self._tenant_deliveries[tenant]:  # the tenant's last: forget its slots
                del self._tenant_deliveries[tenant], self._tenant_slots[tenant]

    async def _promote(self, free: int) -> None:
        """Let the heads of due waiting lines out; a failure here stops no other work."""
        try:
            await self.queue.promote(free, self.visibility_timeout)
        except StoreUnavailable as exc:
            log.warning("waiting lines not looked at: %s", exc)

    async def _run(self, job: Job, delivery: Delivery, lease: str, admission: _Admission) -> int:
        """Execute the job; the FINISH outcome (0, 1, 2), -1 when it was queued again after a
        failure, -2 when it was not run yet (``Deferred``). A job let out of a waiting line
        lets the next out once it holds its tokens (``admitted``), or else when it ends."""
        token = _admission.set(admission)
        try:
            with Serving():  # the loop's lag clock ticks finely while a job runs
                result = await self.execute(job)
        except Deferred as deferred:
            trace.get_current_span().set_attribute(
                attr.JOB_DEFERRED_MS, round(deferred.retry_after * 1000)
            )
            await self.queue.park(delivery, lease, deferred.retry_after)
            return -2  # the line waits for its window: no next let out
        except asyncio.CancelledError:
            await asyncio.shield(self.queue.requeue(delivery, lease, None, refund=True))
            await asyncio.shield(admission.release())
            raise
        except PipelineError as exc:
            error = exc.to_dict()["error"]
            transient = exc.status_code >= 500
        except Exception:
            log.exception("job %s failed", job.id)
            error, transient = dict(INTERNAL_ERROR), True
        else:
            await admission.release()
            return await self.queue.finish(delivery, lease, SUCCEEDED, result)
        finally:
            _admission.reset(token)
        await admission.release()
        mark_failed(trace.get_current_span(), kind=str(error.get("code")))
        if transient and job.attempts < job.max_attempts:
            await asyncio.sleep(self.retry_backoff * 2 ** (job.attempts - 1))
            await self.queue.requeue(delivery, lease, error, refund=False)
            return -1
        return await self.queue.finish(delivery, lease, FAILED, error)

    async def _deliver(self, delivery: Delivery, lease: str) -> None:
        """Deliver, recording each attempt, then settle: the final state and the attempts are
        written together (``settle_webhook``), so a record lost on the way (Redis briefly
        away) cannot leave them disagreeing."""
        try:
            job = await self.queue.get(delivery.job_id)
        except JobUnreadable:
            log.error("job %s: webhook not sent: its record cannot be read", delivery.job_id)
            await self._settle_unsent(delivery, lease)
            return
        if job is None:
            return
        attempts = list(job.deliveries)
        if self.webhooks is None:
            log.error("job %s has a webhook but this worker cannot deliver it", job.id)
            if not ended(attempts):
                attempts.append(unsent(len(attempts) + 1, "this worker has no webhook sender"))
            await self.queue.settle_webhook(delivery, lease, webhook_state(attempts), attempts)
            return

        async def record(deliveries: list[dict[str, Any]]) -> None:
            nonlocal attempts
            attempts = list(deliveries)
            try:
                ours = await self.queue.record_deliveries(delivery, lease, deliveries)
            except StoreUnavailable as exc:
                log.warning("job %s: delivery attempt not recorded: %s", job.id, exc)
                return
            if not ours:
                raise _TakenOver

        try:
            await self.webhooks.deliver(job, record)
        except _TakenOver:
            log.warning("job %s: its delivery was taken over by another worker", job.id)
            return
        await self.queue.settle_webhook(delivery, lease, webhook_state(attempts), attempts)


class _Admission:
    """The waiting line a running job was let out of, and whether the next have been let out."""

    def __init__(self, worker: JobWorker, line: str) -> None:
        self.worker = worker
        self.line = line
        self.done = not line

    async def release(self) -> None:
        """Let the next jobs of the line out, once (a failure leaves them to the line's
        fallback time)."""
        if self.done:
            return
        self.done = True
        try:
            await self.worker.queue.next_in_line(self.line, self.worker.visibility_timeout)
        except StoreUnavailable as exc:
            log.warning("waiting line %s: the next job not let out: %s", self.line[:80], exc)


_admission: ContextVar[_Admission | None] = ContextVar("rag_job_admission", default=None)


async def admitted() -> None:
    """Said by ``execute`` once its job holds its tokens (``app.jobs.run_job``): a job let out
    of its key's waiting line lets the next two out now, not when it ends, so a line whose
    window has room drains in doubling steps. Nothing for any other job."""
    admission = _admission.get()
    if admission is not None:
        await admission.release()


class _TakenOver(Exception):
    """This worker's lease on a delivery is gone: another worker delivers it now."""


def _log_fault(task: asyncio.Task[None], delivery: Delivery) -> None:
    """Log what ended a job's task with an error none of its handlers expected (retrieving it,
    so asyncio does not report it later without context). Its entry stays pending: another
    worker takes it over, and ``start`` fails it once its attempts are spent."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("job %s: its task failed", delivery.job_id, exc_info=exc)


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
