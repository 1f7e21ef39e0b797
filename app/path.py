"""The request paths, built from settings and the services by one function, ``build_paths``,
called from the app's lifespan and by ``rag worker``: the API and the job workers run the same
``chat`` runner, so a job runs exactly what a chat request runs.

    auth -> validate -> guard_in -> cache_lookup -> adapt
         -> [features || retrieve || tools || guard_similarity] -> compress -> route -> generate
         -> guard_out -> cache_store

A stage whose part is switched off in the settings is left out; ``Runner`` checks that what
is left still fits together (every field a stage reads is written before it).

``submit`` is the short path a job takes when it is submitted (validate, then guard_in, on a
context whose principal is already resolved): a job the path would refuse is refused then, and
its messages are stored as guard_in left them (PII redacted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from pipeline.errors import StoreBusy, StoreUnavailable
from pipeline.model.salt import MemoScope, PrefixCacheSalt
from pipeline.routing.load import LoadPolicy
from pipeline.runner import INPUTS, Concurrent, Runner, Stage, Step
from pipeline.stages.adapt import AdaptToLoad
from pipeline.stages.auth import Authenticate
from pipeline.stages.cache import CacheLookup, CacheStore, ResponseCache, no_index
from pipeline.stages.compress import CompressSources
from pipeline.stages.generate import Generate
from pipeline.stages.guard_in import GuardInput
from pipeline.stages.guard_out import GuardOutput
from pipeline.stages.guard_similarity import GuardSimilarity
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.route import ChooseRoute
from pipeline.stages.tools import PlannedTools
from pipeline.stages.validate import ValidateRequest
from pipeline.store.kv import KeyValueStore
from pipeline.store.singleflight import SingleFlight
from pipeline.tools.planner import ToolPlanner
from retrieval import RelevanceGate

if TYPE_CHECKING:
    from app.services import Services
    from app.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Paths:
    """The runners of the service: ``chat``, the request path (the API and the job workers),
    and ``submit``, a job's checks when it is submitted."""

    chat: Runner
    submit: Runner


def build_paths(settings: Settings, services: Services) -> Paths:
    chat = Runner(build_steps(settings, services), services.tracer, observers=services.observers)
    submit = Runner(
        [validate_stage(settings, services), *optional(guard_in_stage(services))],
        services.tracer,
        inputs=INPUTS | {"principal"},
    )
    return Paths(chat=chat, submit=submit)


async def get_paths(request: Request) -> Paths:
    paths: Paths = request.app.state.paths
    return paths


PathsDep = Annotated[Paths, Depends(get_paths)]


def build_steps(settings: Settings, services: Services) -> list[Step]:
    features = features_stage(settings, services)
    retrieve = retrieve_stage(settings, services, with_features=features is not None)
    steps: list[Step] = [
        Authenticate(
            services.keys,
            scope="chat",
            ready=services.retrieval.ready if services.retrieval is not None else None,
        ),
        validate_stage(settings, services),
        *optional(guard_in_stage(services)),
        *optional(cache_lookup_stage(settings, services, personalised=features is not None)),
        *optional(adapt_stage(settings, services)),
    ]
    gathered = optional(
        features,
        retrieve,
        tools_stage(settings, services),
        guard_similarity_stage(services, beside_retrieval=retrieve is not None),
    )
    steps.extend([Concurrent(*gathered)] if len(gathered) > 1 else gathered)
    steps.extend(optional(compress_stage(settings, services)))
    steps.extend(optional(route_stage(settings, services, with_features=features is not None)))
    steps.append(
        Generate(
            services.routes,
            services.chat,
            server_tools=services.server_tools,
            invoker=services.tool_invoker,
            max_rounds=settings.tools.max_rounds,
            access=services.tool_access,
            policies=services.guards.policies if services.guards is not None else None,
            counter=services.tokens,
            context_length=settings.llm.context_length,
            flights=single_flight(settings, services),
            salt=prefix_cache_salt(settings, services),
            memo_scope=memo_scope(services),
        )
    )
    steps.extend(optional(guard_out_stage(services)))
    if settings.cache.enabled:
        steps.append(CacheStore(response_cache(settings, services.kv)))
    return steps


def memo_scope(services: Services) -> MemoScope:
    """Whose memos a request's texts are kept in: its tenant's, and its access scope's where the
    tenant's index has access lists (as the prompt's salt, but never off)."""
    search = services.retrieval
    return MemoScope(search.access_scope if search is not None else None)


def prefix_cache_salt(settings: Settings, services: Services) -> PrefixCacheSalt | None:
    """The model server's prefix cache salted per tenant and access scope, unless it is off."""
    if settings.llm.prefix_cache_salt == "off":
        return None
    secret = settings.llm.prefix_cache_secret
    search = services.retrieval
    return PrefixCacheSalt(
        secret.get_secret_value().encode() if secret is not None else b"",
        search.access_scope if search is not None else None,
    )


def validate_stage(settings: Settings, services: Services) -> ValidateRequest:
    """The checks of a request the schema cannot make (the API's path and job submission)."""
    return ValidateRequest(
        routes=services.routes,
        context_length=settings.llm.context_length,
        server_tools=services.server_tools,
        tool_access=services.tool_access,
        memo_scope=memo_scope(services),
    )


def optional(*stages: Stage | None) -> list[Stage]:
    return [stage for stage in stages if stage is not None]


def response_cache(settings: Settings, kv: KeyValueStore) -> ResponseCache:
    prefix = f"{settings.redis.key_prefix}cache:"
    return ResponseCache(kv, ttl=settings.cache.ttl_seconds, prefix=prefix)


async def erase_cached_answers(
    settings: Settings, kv: KeyValueStore, tenant: str, version: str
) -> int | None:
    """A delete's erasure of the tenant's cached answers (``ResponseCache.erase``; ``version``:
    the one the delete published): how many went; None when Redis could not take it (the
    answers then expire within the cache's TTL, and no request finds them meanwhile: the index
    version is part of their keys)."""
    try:
        return await response_cache(settings, kv).erase(tenant, version)
    except (StoreUnavailable, StoreBusy) as exc:
        log.warning("tenant %s's cached answers were not erased after a delete: %s", tenant, exc)
    except Exception:
        # The delete is published already: an answer other than 200 would make the caller
        # try again, and meet a 404.
        log.exception("tenant %s's cached answers were not erased after a delete", tenant)
    return None


def single_flight(settings: Settings, services: Services) -> SingleFlight | None:
    """Request coalescing, when the cache and coalescing are on: it shares exactly the
    answers the cache would keep, and a new leader looks in the cache once more."""
    if not (settings.cache.enabled and settings.cache.coalesce):
        return None
    return SingleFlight(
        services.kv,
        prefix=f"{settings.redis.key_prefix}flight:",
        cached=response_cache(settings, services.kv).get,
        # XREAD BLOCK well within the Redis client's socket timeout.
        poll_ms=max(10, int(settings.redis.timeout_seconds * 250)),
    )


def cache_lookup_stage(
    settings: Settings, services: Services, *, personalised: bool
) -> Stage | None:
    if not settings.cache.enabled:
        return None
    search = services.retrieval
    return CacheLookup(
        response_cache(settings, services.kv),
        search.version if search is not None else no_index,
        personalised=personalised,
        versions=services.versions(),
        access_scope=search.access_scope if search is not None else None,
    )


def load_policy(settings: Settings) -> LoadPolicy | None:
    """How requests adapt to a loaded route, when switched on."""
    config = settings.adapt
    if not config.enabled:
        return None
    return LoadPolicy(
        top_k_at=config.top_k_at,
        compress_at=config.compress_at,
        small_route_at=config.small_route_at,
        top_k=config.top_k,
        budget_tokens=config.budget_tokens,
    )


def adapt_stage(settings: Settings, services: Services) -> Stage | None:
    """Fewer, shorter sources under load, when adaptation is on and there can be sources."""
    policy = load_policy(settings)
    if policy is None or services.retrieval is None:
        return None
    return AdaptToLoad(
        services.routes,
        policy,
        budget_tokens=settings.compress.budget_tokens,
        compress=settings.compress.enabled,
    )


def compress_stage(settings: Settings, services: Services) -> Stage | None:
    """Compression of the sources, when there can be sources (retrieval is on). Left in the
    path when switched off in the settings, since a request may ask for it."""
    search = services.retrieval
    if search is None:
        return None
    config = settings.compress
    return CompressSources(
        services.tokens,
        budget_tokens=config.budget_tokens,
        enabled=config.enabled,
        idf=search.idf,
        memo_scope=memo_scope(services),
    )


def guard_in_stage(services: Services) -> Stage | None:
    guards = services.guards
    if guards is None:
        return None
    return GuardInput(guards.policies, guards.rules_only, services.tokens, memo_scope(services))


def guard_similarity_stage(services: Services, *, beside_retrieval: bool) -> Stage | None:
    guards, search = services.guards, services.retrieval
    if guards is None or guards.detector.exemplars is None or search is None:
        return None
    return GuardSimilarity(
        guards.policies,
        guards.detector,
        search.embed,
        beside_retrieval=beside_retrieval,
        memo_scope=memo_scope(services),
    )


def guard_out_stage(services: Services) -> Stage | None:
    guards = services.guards
    return None if guards is None else GuardOutput(guards.policies, services.tracer)


def retrieve_stage(settings: Settings, services: Services, *, with_features: bool) -> Stage | None:
    if services.retrieval is None:
        return None
    filters = services.feature_filters() if with_features else None
    gate = RelevanceGate.configured(settings.retrieval.relevance_threshold)
    return Retrieve(
        services.retrieval, feature_filters=filters, gate=gate, memo_scope=memo_scope(services)
    )


def features_stage(settings: Settings, services: Services) -> Stage | None:
    """The user's features (the feature store's stage), when switched on."""
    from pipeline.stages.features import LoadFeatures

    config = settings.features
    if not config.enabled or services.features is None:
        return None
    return LoadFeatures(
        services.features,
        timeout_s=config.timeout_seconds,
        log_requests=config.log_requests,
    )


def tools_stage(settings: Settings, services: Services) -> Stage | None:
    """The planned tools, run beside retrieval, when switched on."""
    if not settings.tools.enabled or services.tool_invoker is None:
        return None
    return PlannedTools(
        ToolPlanner(services.server_tools), services.tool_invoker, services.tool_access
    )


def route_stage(settings: Settings, services: Services, *, with_features: bool) -> Stage | None:
    """The router's stage, when routing is on and there is more than one route (the router is
    built only then)."""
    if services.router is None or not settings.routing.enabled:
        return None
    search = services.retrieval
    return ChooseRoute(
        services.router,
        embed=search.embed if search is not None else None,
        with_features=with_features,
        with_query_vector=search is not None,
        timeout_s=settings.routing.timeout_seconds,
        load=load_policy(settings),
        memo_scope=memo_scope(services),
    )
