"""The long-lived collaborators of the app, built in the lifespan and closed there.

``Services.build`` makes the clients (Redis, the model routes, retrieval, the feature store,
the tools); it holds collaborators only. ``app.path.build_paths`` makes the request paths from
them; job workers build the same ``Services`` and paths, so they run the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from opentelemetry import trace

from app.settings import RetrievalSettings, Settings, SettingsError
from app.stores import build_feature_store, build_key_store
from pipeline.answer import citations
from pipeline.features import FEATURE_SET_VERSION, FeatureStore
from pipeline.features.spec import filter_keys
from pipeline.guards.injection import ExemplarIndex, InjectionDetector
from pipeline.guards.policy import PolicyBook, PolicyError
from pipeline.model.chat import TracedChat
from pipeline.model.client import LLMClient
from pipeline.model.routes import Route, RouteTable
from pipeline.model.slots import SlotPool
from pipeline.model.tokens import ApproximateTokenCounter, TokenCounter, load_token_counter
from pipeline.routing.router import Centroids, Router, RouterPolicy, load_examples
from pipeline.routing.rules import Thresholds
from pipeline.runner import StageObserver
from pipeline.sources import conversation
from pipeline.sources.search import PassageSearch
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from pipeline.store.limits import LimitConfig, RateLimiter
from pipeline.telemetry import metrics
from pipeline.telemetry.metrics import StageMetrics
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import Tool, ToolError
from pipeline.tools.builtins import builtin_tools
from pipeline.tools.http import HttpTool
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.loop import Invoker
from pipeline.tools.registry import ToolRegistry
from retrieval import Embedder, HybridRetriever, IndexStore, QueryBatcher, make_embedder
from retrieval.backends import RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.lazy import LazyBackend
from retrieval.backends.router import BackendRouter, RedisOverrides
from retrieval.backends.versions import RedisVersions, VersionCounter
from retrieval.files import ConverterPool, ZipLimits


@dataclass
class Services:
    settings: Settings
    tracer: trace.Tracer
    kv: KeyValueStore
    keys: ApiKeyStore
    routes: RouteTable
    limits: RateLimiter | None = None
    retrieval: PassageSearch | None = None
    converter: ConverterPool | None = None  # document files in (POST /v1/files)
    features: FeatureStore | None = None
    router: Router | None = None
    server_tools: dict[str, Tool] = field(default_factory=dict)
    tool_invoker: Invoker | None = None
    tool_access: ToolAccess = field(default_factory=ToolAccess)
    observers: list[StageObserver] = field(default_factory=list)
    tokens: TokenCounter = field(default_factory=ApproximateTokenCounter)
    guards: Guards | None = None

    def __post_init__(self) -> None:
        self.chat = TracedChat(
            self.tracer,
            capture_content=self.settings.telemetry.capture_content,
            counter=self.tokens,
        )

    @property
    def llm(self) -> LLMClient:
        """The default route's client (health checks, model listing)."""
        return self.routes.get(self.routes.default).client

    def versions(self) -> dict[str, str]:
        """Versions of what shapes an answer besides the request (part of the cache key)."""
        config = self.settings
        versions = {
            "relevance": str(config.retrieval.relevance_threshold),
            "compress": f"{config.compress.enabled}:{config.compress.budget_tokens}",
            "conversation": conversation.VERSION,
            "citations": citations.VERSION,
        }
        if self.features is not None:
            versions["features"] = FEATURE_SET_VERSION
        if self.router is not None:
            versions["router"] = self.router.version
        return versions

    def feature_filters(self) -> dict[str, str]:
        """Feature name -> metadata key: features that become a default retrieval filter."""
        return filter_keys(self.features.specs) if self.features is not None else {}

    @classmethod
    def build(
        cls, settings: Settings, tracer: trace.Tracer, embedder: Embedder | None = None
    ) -> Services:
        # What settings name but only building can check, first: a bad tool or policy stops
        # the start before a model is loaded or a connection opened.
        http_tools = build_http_tools(settings)
        policies = build_policies(settings)
        kv = KeyValueStore.from_url(
            settings.redis.url,
            tracer,
            timeout=settings.redis.timeout_seconds,
            retry_after=settings.redis.retry_after_seconds,
            max_connections=settings.redis.max_connections,
            pool_wait=settings.redis.pool_wait_seconds,
            cluster=settings.redis.cluster,
        )
        keys = build_key_store(settings, kv)
        retrieval = None
        queries: Embedder | None = None
        if settings.retrieval.enabled:
            # One embedding model for queries and, unless one was given to share, another for
            # ingestion (loaded on first use): a model runs one batch at a time, and a query
            # must not wait seconds behind an ingest's batch of passages.
            # No ONNX memory arena in a replica: it would hold an ingest batch's activations
            # (about 100 MB) for good; bulk ingestion (`rag ingest`) keeps it, for speed.
            config = settings.retrieval
            queries = embedder or make_embedder(
                config.embeddings, config.query_torch_threads, arena=False
            )
            ingest = embedder or make_embedder(
                config.ingest_embeddings or config.embeddings,
                config.ingest_torch_threads,
                arena=False,
            )
            retrieval = build_search(settings, tracer, queries, ingest)
        routes = build_routes(settings)
        return cls(
            settings=settings,
            tracer=tracer,
            kv=kv,
            keys=keys,
            limits=build_limiter(settings, kv),
            routes=routes,
            router=build_router(settings, routes, queries),
            retrieval=retrieval,
            converter=build_converter(settings) if retrieval is not None else None,
            features=build_feature_store(settings, kv) if settings.features.enabled else None,
            observers=build_observers(settings),
            tokens=load_token_counter(settings.llm.tokenizer_path),
            guards=build_guards(settings, policies, queries),
            **build_tools(settings, tracer, retrieval, http_tools),
        )

    async def aclose(self) -> None:
        if self.retrieval is not None:
            await self.retrieval.aclose()
        if self.converter is not None:
            self.converter.close()
        await self.routes.aclose()
        await self.keys.aclose()
        if self.limits is not None:
            await self.limits.aclose()
        await self.kv.aclose()


@dataclass(frozen=True)
class Guards:
    """The guardrails' collaborators: the tenants' policies and the injection detector (with
    the embedded attack exemplars when the similarity check is on)."""

    policies: PolicyBook
    detector: InjectionDetector
    rules_only: InjectionDetector


def build_policies(settings: Settings) -> PolicyBook:
    """The tenants' guard policies from ``RAG_GUARD__POLICY`` (checked even with guards off,
    so switching them on cannot reveal a broken policy)."""
    try:
        return PolicyBook.from_json(settings.guard.policy)
    except PolicyError as exc:
        raise SettingsError(f"RAG_GUARD__POLICY: {exc}") from None


def build_guards(
    settings: Settings, policies: PolicyBook, embedder: Embedder | None
) -> Guards | None:
    config = settings.guard
    if not config.enabled:
        return None
    exemplars = None
    if config.similarity and embedder is not None:
        exemplars = ExemplarIndex.from_file(embedder)  # ~100 short texts, embedded once
    return Guards(policies, InjectionDetector(exemplars), InjectionDetector())


def build_observers(settings: Settings) -> list[StageObserver]:
    """The stage metrics hang on the runner, not on each stage (the request log reads the
    context the route hands it: ``app.logs.hand_to_log``)."""
    observers: list[StageObserver] = []
    if settings.telemetry.metrics:
        observers.append(StageMetrics())
    return observers


def build_routes(settings: Settings) -> RouteTable:
    """One client (its own connection pool) and one concurrency bound per route, in all and
    per tenant (a bound of this process: each replica bounds its own upstream calls)."""
    llm = settings.llm
    routes = {
        name: Route(
            name=name,
            model=config.model,
            client=LLMClient(
                config.base_url,
                api_key=config.api_key,
                connect_timeout=llm.connect_timeout_seconds,
                read_timeout=llm.read_timeout_seconds,
                max_connections=llm.max_connections,
            ),
            slots=SlotPool(config.max_concurrency, config.tenant_concurrency, name=name),
        )
        for name, config in settings.routing.resolved(llm).items()
    }
    return RouteTable(routes, default=settings.routing.default)


def build_router(
    settings: Settings, routes: RouteTable, embedder: Embedder | None
) -> Router | None:
    """The router, when routing is on and there is a choice; with centroids when there is a
    query embedder (retrieval on), embedded now unless the model is not to load at start-up."""
    config = settings.routing
    if not config.enabled or len(routes.routes) < 2:
        return None
    intents = {"small": config.small_route, "large": config.large_route}
    unknown = sorted(set(intents.values()) - set(routes.routes))
    if unknown:
        raise ValueError(
            f"RAG_ROUTING__SMALL_ROUTE / __LARGE_ROUTE name routes that are not configured: "
            f"{', '.join(unknown)} (routes: {', '.join(sorted(routes.routes))})"
        )
    policy = RouterPolicy(
        intents=intents,
        thresholds=Thresholds(
            long_words=config.long_words,
            long_chars=config.long_chars,
            short_words=config.short_words,
        ),
        capped_tiers=frozenset(config.capped_tiers),
    )
    centroids = None
    if embedder is not None:
        centroids = Centroids(load_examples(), embedder.embed)
        if settings.retrieval.warm_up:
            centroids.warm_up()  # a few dozen short prompts: a fraction of a second
    return Router(routes, policy, centroids)


def build_http_tools(settings: Settings) -> list[HttpTool]:
    """The configured HTTP tools (``RAG_TOOLS__HTTP``), each checked against its allow-list."""
    tools = []
    for config in settings.tools.http:
        try:
            tools.append(HttpTool(**config.tool_options()))
        except ToolError as exc:
            raise SettingsError(f"RAG_TOOLS__HTTP: tool {config.name}: {exc}") from None
    return tools


def build_tools(
    settings: Settings,
    tracer: trace.Tracer,
    retrieval: PassageSearch | None,
    http_tools: list[HttpTool],
) -> dict[str, Any]:
    """``server_tools``, ``tool_invoker`` and ``tool_access``: the built-ins (the document
    search only with retrieval) and the configured HTTP tools, behind one invoker whose limits
    all requests share, and which tenant may use which. Nothing when tools are off."""
    config = settings.tools
    if not config.enabled:
        return {}
    registry = ToolRegistry(
        builtin_tools(
            retrieval, timeout_s=config.timeout_seconds, max_concurrency=config.max_concurrency
        )
    )
    for http in http_tools:
        registry.add(http.tool())
    invoker = ToolInvoker(registry, tracer, capture_content=settings.telemetry.capture_content)
    access = ToolAccess.from_settings(
        {tenant: (entry.allow, entry.private_network) for tenant, entry in config.tenants.items()},
        private=[http.name for http in config.http if http.allow_private],
    )
    return {"server_tools": registry.tools, "tool_invoker": invoker, "tool_access": access}


def build_limiter(settings: Settings, kv: KeyValueStore) -> RateLimiter | None:
    config = settings.limits
    if not config.enabled:
        return None
    tenants = {
        tenant: {name: value for name, value in limits.model_dump().items() if value is not None}
        for tenant, limits in config.tenants.items()
    }
    return RateLimiter(
        kv,
        LimitConfig(
            key_rpm=config.key_rpm,
            key_tpm=config.key_tpm,
            tenant_rpm=config.tenant_rpm,
            tenant_tpm=config.tenant_tpm,
            tenants=tenants,
            window_seconds=config.window_seconds,
            fail_open=config.fail_open,
        ),
        prefix=settings.redis.key_prefix,
    )


def build_index_store(config: RetrievalSettings, embedder: Embedder) -> IndexStore:
    store = IndexStore(
        config.index_dir,
        embedder,
        chunk_words=config.chunk_words,
        overlap_words=config.overlap_words,
        max_document_chars=config.max_document_chars,
        approximate_above=config.approximate_above,
        lock_wait_s=config.write_lock_wait_seconds,
        loaded_bytes=config.loaded_indexes_mb * 2**20 or None,
    )
    store.on_let_go = metrics.index_let_go
    metrics.INDEX_LOADED_BYTES.set_function(lambda: store.loaded_bytes)
    return store


def build_converter(settings: Settings) -> ConverterPool:
    config = settings.files
    return ConverterPool(
        workers=config.convert_workers,
        timeout_seconds=config.convert_timeout_seconds,
        memory_bytes=config.convert_memory_bytes,
        max_chars=settings.retrieval.max_document_chars,
        max_uploads=config.max_pending_uploads,
        per_tenant=config.convert_tenant_workers,
        zip_limits=ZipLimits(
            max_total_bytes=config.max_unzipped_bytes, max_ratio=config.max_zip_ratio
        ),
    )


def build_milvus(
    settings: Settings, embedder: Embedder, versions: VersionCounter
) -> RetrievalBackend:
    """The Milvus backend of the settings (Milvus Lite for a file path), connected now; its
    index versions are counters in the settings' Redis, which the app and `rag` share."""
    from retrieval.backends.milvus import MilvusBackend, close, connect

    config = settings.retrieval
    options: dict[str, Any] = {"candidates": config.candidates} if config.candidates else {}
    client = connect(config.milvus_location(), config.milvus_timeout_seconds)
    try:
        return MilvusBackend(
            client,
            config.milvus_collection,
            embedder,
            versions,
            chunk_words=config.chunk_words,
            overlap_words=config.overlap_words,
            max_document_chars=config.max_document_chars,
            timeout_s=config.milvus_timeout_seconds,
            typed_fields=config.milvus_typed_fields,
            tenant_collections=config.milvus_tenant_collections,
            **options,
        )
    except BaseException:
        close(client)  # its collections could not be made ready: no client (or Lite server) left
        raise


def build_backends(
    settings: Settings,
    store: IndexStore,
    retriever: HybridRetriever,
    embedder: Embedder,
    *,
    connect_now: bool = True,
) -> BackendRouter:
    """The backends and which tenant uses which: the embedded one always; Milvus when the
    settings name it (or give its URI), with run-time overrides (`rag backend move`) in Redis.

    Milvus is built on its first use (``retrieval.backends.lazy``), so that while it cannot be
    reached only its own tenants are refused. ``connect_now`` (the app) tries it at once, so
    that the first request for one of its tenants does not wait for the connection, and later
    connects in a thread of its own; a command leaves it until a tenant on it is touched."""
    config = settings.retrieval
    backends: dict[str, RetrievalBackend] = {"embedded": EmbeddedBackend(store, retriever)}
    overrides = None
    if config.uses_milvus:
        from retrieval.backends.milvus import MilvusNotInstalled, VersionAnswers

        versions = RedisVersions(
            settings.redis.url,
            settings.redis.key_prefix,
            timeout_s=max(settings.redis.timeout_seconds, 0.5),
            cluster=settings.redis.cluster,
        )
        milvus = LazyBackend(
            "milvus",
            lambda: build_milvus(settings, embedder, versions),
            VersionAnswers(versions),
            permanent=(MilvusNotInstalled,),
            background=connect_now,
        )
        if connect_now:
            milvus.try_build()
        backends["milvus"] = milvus
        overrides = RedisOverrides(
            settings.redis.url,
            settings.redis.key_prefix,
            timeout_s=max(settings.redis.timeout_seconds, 0.5),
            cluster=settings.redis.cluster,
        )
    fence = overrides.fence() if overrides is not None else None
    try:
        return BackendRouter(backends, config.backend, config.tenant_backends, overrides, fence)
    except ValueError as exc:
        raise SettingsError(f"RAG_RETRIEVAL: {exc}") from None


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
    # An ONNX embedder sets its own threads (make_embedder); pinning torch's would import it.
    queries = QueryBatcher(
        query_embedder,
        max_batch=config.query_batch_max,
        window_s=config.query_batch_window_seconds,
        torch_threads=config.query_torch_threads if query_embedder.backend == "torch" else 0,
    )
    return PassageSearch(
        store,
        retriever,
        queries,
        tracer,
        search_threads=config.search_threads,
        ingest_threads=config.ingest_threads,
        ingest_torch_threads=(
            config.ingest_torch_threads if ingest_embedder.backend == "torch" else 0
        ),
        backends=build_backends(settings, store, retriever, ingest_embedder),
    )


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request
    # (measured on the cache-hit path: see BENCHMARKS.md).
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
