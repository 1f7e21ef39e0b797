"""The FastAPI app factory."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from opentelemetry.sdk.trace import SpanProcessor

from app import metrics
from app.http.auth import AuthenticateFirst
from app.http.errors import install_error_handlers
from app.http.fastpath import MAX_BODY_BYTES, CacheFastPath
from app.http.limits import RateLimits
from app.http.middleware import BodySizeLimit, RequestTracing
from app.http.openapi import document_models
from app.http.schemas import ChatCompletionRequest
from app.http.shutdown import DrainOnShutdown, Shutdown
from app.jobs import start_job_workers
from app.lag import LagProbe
from app.logs import RequestLog, configure_logging
from app.path import build_paths
from app.routes import chat, files, health, jobs, models, retrieval
from app.routes import metrics as metrics_route
from app.routes.jobs import JobRequest
from app.routes.retrieval import DeleteRequest, IngestRequest, RetrieveRequest
from app.services import Services
from app.settings import Settings, get_settings
from app.telemetry import build_tracer_provider, tracer_from
from retrieval import Embedder


def create_app(
    settings: Settings | None = None,
    *,
    span_processors: list[SpanProcessor] | None = None,
    embedder: Embedder | None = None,
    shutdown: Shutdown | None = None,
) -> FastAPI:
    """The app. ``embedder``, when given, is shared by queries and ingestion (tests share one
    loaded model across apps); by default each gets its own. ``shutdown`` is what the server
    (`rag serve`'s ``DrainingServer``) drives when it is told to stop."""
    settings = settings or get_settings()
    configure_logging(settings.log, settings.environment)
    settings.warn_development()
    provider = build_tracer_provider(settings, span_processors)
    tracer = tracer_from(provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, tracer, embedder)
        if services.retrieval is not None and settings.retrieval.warm_up:
            await asyncio.to_thread(services.retrieval.queries.embedder.warm_up)
        paths = build_paths(settings, services)
        app.state.services = services
        app.state.paths = paths
        # Everything built so far (the models, indexes, clients: millions of objects) lives as
        # long as the process; the cyclic GC need never walk it again. Without this a full
        # collection, set off by any request that allocates much, holds the loop for 50-200 ms.
        # Before the job workers start: the collection holds the loop, and their first Redis
        # commands would wait out their deadlines behind it.
        gc.collect()
        gc.freeze()
        job_workers = await start_job_workers(services, paths.chat)
        probe = LagProbe(record=settings.telemetry.metrics).start()
        app.state.lag_probe = probe
        # Key revocations and limit changes from any replica reach this one's key cache.
        key_changes = asyncio.get_running_loop().create_task(services.keys.listen())
        # Served once it is subscribed (a second at most: Redis may be down): the first
        # subscription forgets every key cached before it, and a lookup overlapping it.
        await services.keys.wait_subscribed(1.0)
        try:
            yield
        finally:
            await services.keys.stop_listening(key_changes)
            await probe.stop()
            await job_workers.stop()
            await services.aclose()
            provider.shutdown()

    app = FastAPI(
        title="RAG pipeline",
        version="0.1.0",
        description="OpenAI-compatible chat completions with retrieval, in front of vLLM.",
        lifespan=lifespan,
        # RequestTracing makes each request's root span and HTTP metrics; FastAPI's own would be
        # a second server span, and asking whether it is on costs every request ~10 µs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    install_error_handlers(app)
    for router in (chat.router, models.router, retrieval.router, health.router, jobs.router):
        app.include_router(router)
    app.include_router(files.router)
    if settings.telemetry.metrics:
        app.include_router(metrics_route.router)
    document_models(
        app, [ChatCompletionRequest, JobRequest, IngestRequest, DeleteRequest, RetrieveRequest]
    )
    # Added last = outermost: the root span covers everything, including the key and size
    # checks; the key is checked, then the rate limits, before anything reads the body.
    app.add_middleware(RateLimits)
    app.add_middleware(AuthenticateFirst)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.server.max_body_bytes,
        paths={files.PATH: settings.files.max_upload_bytes},
    )
    if settings.cache.enabled and settings.cache.fast_path:
        # Plain cache hits are answered here, before the body limit, key check and rate
        # limits (which it applies itself), inside the shutdown handling and the root span.
        app.add_middleware(
            CacheFastPath, max_body_bytes=min(MAX_BODY_BYTES, settings.server.max_body_bytes)
        )
    # While the process shuts down, new requests get a 503 before any other work.
    app.add_middleware(DrainOnShutdown, shutdown=shutdown or Shutdown())
    app.add_middleware(
        RequestTracing,
        tracer=tracer,
        metrics=metrics.HttpMetrics() if settings.telemetry.metrics else None,
        request_log=RequestLog() if settings.log.requests else None,
        follow_callers=settings.telemetry.caller_trace == "follow",
    )
    return app
