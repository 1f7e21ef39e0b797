"""The FastAPI app factory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from opentelemetry.sdk.trace import SpanProcessor

from app.errors import install_error_handlers
from app.middleware import BodySizeLimit, RequestTracing
from app.routes import chat, health, models, retrieval
from app.services import Services
from app.settings import Settings, get_settings
from app.telemetry import build_tracer_provider, tracer_from
from retrieval import Embedder


def create_app(
    settings: Settings | None = None,
    *,
    span_processors: list[SpanProcessor] | None = None,
    embedder: Embedder | None = None,
) -> FastAPI:
    """The app. ``embedder``, when given, is shared by queries and ingestion (tests share one
    loaded model across apps); by default each gets its own."""
    settings = settings or get_settings()
    provider = build_tracer_provider(settings, span_processors)
    tracer = tracer_from(provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, tracer, embedder)
        if services.retrieval is not None and settings.retrieval.warm_up:
            await asyncio.to_thread(services.retrieval.queries.embedder.warm_up)
        app.state.services = services
        try:
            yield
        finally:
            await services.aclose()
            provider.shutdown()

    app = FastAPI(
        title="RAG pipeline",
        version="0.1.0",
        description="OpenAI-compatible chat completions with retrieval, in front of vLLM.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    for router in (chat.router, models.router, retrieval.router, health.router):
        app.include_router(router)
    # Added last = outermost: the root span covers everything, including the size check.
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(RequestTracing, tracer=tracer)
    return app
