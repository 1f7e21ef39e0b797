"""Jobs on the app side: how a job runs (the same path as a chat request), and the workers.

``run_job`` is the one place that turns a stored job into a request context and runs it.
``start_job_workers`` starts the in-process workers (``RAG_JOBS__WORKERS``); ``rag worker``
runs the same workers in a process of their own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from app.http.responses import chat_completion
from app.http.schemas import ChatCompletionRequest
from app.services import Services
from app.settings import Settings
from app.stores import job_queue, webhook_secrets
from pipeline.context import CacheControl, Principal, RequestContext
from pipeline.errors import AuthenticationFailed
from pipeline.jobs.model import Job
from pipeline.jobs.urls import UrlPolicy
from pipeline.jobs.webhooks import WebhookSender
from pipeline.jobs.worker import Deferred, JobWorker, admitted
from pipeline.model.spend import Spend, estimated_tokens, spent
from pipeline.runner import Runner
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from pipeline.store.limits import RateLimiter, Reservation

log = logging.getLogger("rag.jobs")


async def run_job(
    settings: Settings,
    runner: Runner,
    job: Job,
    limits: RateLimiter | None = None,
    keys: ApiKeyStore | None = None,
) -> dict[str, Any]:
    """Run ``job`` through the request path; the chat completion it answers with.

    The context arrives with the job's key as it is now (``keys``; the principal stored with
    the job where no store is given) and no credential: the auth stage then checks that the key
    is still active (a revoked key fails the job with a 401 error) and that it still carries
    the ``chat`` scope. Errors are the path's own ``PipelineError``s. The job holds its
    estimated tokens in its key's and tenant's ``limits`` before it runs (``Deferred`` while
    they are full), and its answer's tokens replace the estimate.
    """
    body = ChatCompletionRequest.model_validate(job.request)
    principal = await _principal_now(job, keys)
    ctx = RequestContext(
        params=body.to_params(settings.retrieval.top_k, settings.llm.default_max_tokens),
        credential=None,
        principal=principal,
        deadline=asyncio.get_running_loop().time() + settings.jobs.timeout_seconds,
        cache_control=CacheControl(),
    )
    held = None if limits is None else await _hold(settings, limits, principal, ctx)
    spend = Spend()  # what the job's model calls spent, charged if it fails after them
    token = spent.set(spend)
    try:
        await admitted()  # the next jobs of its key's waiting line may go
        await runner.run(ctx)
        if ctx.completion is None:
            raise RuntimeError("the path ended without an answer")
    except BaseException:  # a worker stopping cancels it: its hold goes as well
        if limits is not None:
            await limits.settle(principal, spend.tokens, held)
        raise
    finally:
        spent.reset(token)
    if limits is not None:
        hit = ctx.cache_status == "hit"  # a cache hit costs no tokens: its hold let go
        await limits.settle(principal, 0 if hit else spend.charge(ctx.completion), held)
    return chat_completion(ctx, ctx.completion)


async def _principal_now(job: Job, keys: ApiKeyStore | None) -> Principal:
    """The job's key as it is now: the limits it is held and charged to, and the groups its
    sources are read with, are the key's current ones (``rag keys limits``, ``rag keys
    groups`` apply to jobs already queued). A key that is gone, or now names another tenant or
    user, fails the job as revoked."""
    stored = job.principal()
    if keys is None:
        return stored
    current = await keys.current(stored.key_id)  # StoreUnavailable: a 503, retried
    if current is None or (current.tenant, current.user) != (stored.tenant, stored.user):
        raise AuthenticationFailed("The API key of this request has been revoked.")
    return current


async def _hold(
    settings: Settings, limits: RateLimiter, principal: Principal, ctx: RequestContext
) -> Reservation | None:
    """Hold the job's estimated tokens in its key's and tenant's token windows, as a chat
    request's are; ``Deferred`` while they are full, so that a key's queued jobs do not run
    past its tokens-per-minute limit (the worker queues the job again, its attempt given
    back, in its key's waiting line)."""
    estimate = estimated_tokens(ctx.params, settings.llm.context_length)
    decision, held = await limits.reserve(principal, estimate)
    if not decision.admitted:
        raise Deferred(decision.retry_after_ms / 1000)
    return held


def webhook_sender(settings: Settings, kv: KeyValueStore, tracer: trace.Tracer) -> WebhookSender:
    jobs = settings.jobs
    return WebhookSender(
        webhook_secrets(settings, kv),
        UrlPolicy(jobs.webhook_allow),
        tracer,
        timeout=jobs.webhook_timeout_seconds,
        connect_timeout=jobs.webhook_connect_timeout_seconds,
        max_attempts=jobs.webhook_max_attempts,
        backoff=jobs.webhook_backoff_seconds,
    )


def polling_store(settings: Settings) -> KeyValueStore:
    """A Redis client for the workers' blocking reads: a socket timeout longer than a read
    blocks, and no span per poll (an idle worker would emit one every second)."""
    return KeyValueStore.from_url(
        settings.redis.url,
        trace.NoOpTracer(),
        timeout=settings.jobs.poll_seconds + max(settings.redis.timeout_seconds, 1.0),
        retry_after=settings.redis.retry_after_seconds,
        cluster=settings.redis.cluster,
    )


@dataclass
class JobWorkers:
    """Running workers and what they hold; ``stop()`` lets running jobs finish."""

    workers: list[JobWorker] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)

    async def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for closer in self.closers:
            await closer.aclose()

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks)


async def start_job_workers(
    services: Services, runner: Runner, count: int | None = None
) -> JobWorkers:
    """Start ``count`` workers (default ``RAG_JOBS__WORKERS``) that run jobs with ``run_job`` on
    ``runner`` (the chat path of ``app.path.build_paths``)."""
    settings = services.settings
    count = settings.jobs.workers if count is None else count
    if count <= 0:
        return JobWorkers()
    poll_kv = polling_store(settings)
    queue = job_queue(settings, services.kv, poll_kv)
    sender = webhook_sender(settings, services.kv, services.tracer)

    async def execute(job: Job) -> dict[str, Any]:
        return await run_job(settings, runner, job, services.limits, services.keys)

    workers = [
        JobWorker(
            queue,
            execute,
            services.tracer,
            concurrency=settings.jobs.concurrency,
            visibility_timeout=settings.jobs.visibility_timeout_seconds,
            poll_seconds=settings.jobs.poll_seconds,
            retry_backoff=settings.jobs.retry_backoff_seconds,
            # A job still running after this is handed back to the queue.
            stop_grace=settings.jobs.visibility_timeout_seconds,
            webhooks=sender,
            sweep_seconds=settings.jobs.sweep_seconds,
            webhook_concurrency=settings.jobs.webhook_concurrency,
            webhook_tenant_concurrency=settings.jobs.webhook_tenant_concurrency,
        )
        for _ in range(count)
    ]
    tasks = [asyncio.create_task(w.run(), name=f"job worker {w.consumer}") for w in workers]
    log.info("started %d job workers (concurrency %d each)", count, settings.jobs.concurrency)
    return JobWorkers(workers, tasks, [sender, poll_kv])
