"""The long-lived collaborators of the app, built in the lifespan and closed there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from opentelemetry import trace

from app.settings import RetrievalSettings, Settings
from pipeline.keys import ApiKeyStore
from pipeline.kv import KeyValueStore
from pipeline.llm import LLMClient
from pipeline.runner import Runner, Step
from pipeline.search import PassageSearch
from pipeline.stages.auth import Authenticate
from pipeline.stages.cache import CacheLookup, CacheStore, ResponseCache, no_index
from pipeline.stages.generate import Generate
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.validate import ValidateRequest
from retrieval import Embedder, HybridRetriever, IndexStore, QueryBatcher


@dataclass
class Services:
    settings: Settings
    tracer: trace.Tracer
    kv: KeyValueStore
    keys: ApiKeyStore
    llm: LLMClient
    retrieval: PassageSearch | None = None
    runner: Runner = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        steps: list[Step] = [
            Authenticate(self.keys, scope="chat"),
            ValidateRequest(models=settings.llm.models, context_length=settings.llm.context_length),
        ]
        cache = ResponseCache(
            self.kv, ttl=settings.cache.ttl_seconds, prefix=f"{settings.redis.key_prefix}cache:"
        )
        if settings.cache.enabled:
            version = self.retrieval.version if self.retrieval is not None else no_index
            steps.append(CacheLookup(cache, version))
        if self.retrieval is not None:
            steps.append(Retrieve(self.retrieval))
        steps.append(
            Generate(self.llm, self.tracer, capture_content=settings.telemetry.capture_content)
        )
        if settings.cache.enabled:
            steps.append(CacheStore(cache))
        self.runner = Runner(steps, self.tracer)

    @classmethod
    def build(
        cls, settings: Settings, tracer: trace.Tracer, embedder: Embedder | None = None
    ) -> Services:
        kv = KeyValueStore.from_url(
            settings.redis.url,
            tracer,
            timeout=settings.redis.timeout_seconds,
            retry_after=settings.redis.retry_after_seconds,
        )
        keys = build_key_store(settings, kv)
        llm = LLMClient(
            settings.llm.base_url,
            api_key=settings.llm.api_key,
            connect_timeout=settings.llm.connect_timeout_seconds,
            read_timeout=settings.llm.read_timeout_seconds,
            max_connections=settings.llm.max_connections,
        )
        retrieval = None
        if settings.retrieval.enabled:
            # One embedding model for queries and, unless one was given to share, another for
            # ingestion (loaded on first use): a model runs one batch at a time, and a query
            # must not wait seconds behind an ingest's batch of passages.
            queries = embedder or Embedder()
            retrieval = build_search(settings, tracer, queries, embedder or Embedder())
        return cls(settings=settings, tracer=tracer, kv=kv, keys=keys, llm=llm, retrieval=retrieval)

    async def aclose(self) -> None:
        if self.retrieval is not None:
            await self.retrieval.aclose()
        await self.llm.aclose()
        await self.kv.aclose()


def build_key_store(settings: Settings, kv: KeyValueStore) -> ApiKeyStore:
    return ApiKeyStore(
        kv,
        prefix=f"{settings.redis.key_prefix}apikey:",
        cache_ttl=settings.auth.key_cache_seconds,
        stale_ttl=settings.auth.key_stale_seconds,
    )


def build_index_store(config: RetrievalSettings, embedder: Embedder) -> IndexStore:
    return IndexStore(
        config.index_dir,
        embedder,
        chunk_words=config.chunk_words,
        overlap_words=config.overlap_words,
        max_document_chars=config.max_document_chars,
        approximate_above=config.approximate_above,
    )


def build_search(
    settings: Settings, tracer: trace.Tracer, query_embedder: Embedder, ingest_embedder: Embedder
) -> PassageSearch:
    config = settings.retrieval
    store = build_index_store(config, ingest_embedder)
    retriever = (
        HybridRetriever(store, candidates=config.candidates)
        if config.candidates
        else HybridRetriever(store)
    )
    queries = QueryBatcher(
        query_embedder, max_batch=config.query_batch_max, window_ms=config.query_batch_window_ms
    )
    return PassageSearch(store, retriever, queries, tracer)


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
