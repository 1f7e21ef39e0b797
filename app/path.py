"""The request path, built from settings by one function: the API and job workers both run
what it returns, so a job runs exactly what a chat request runs.

    auth -> validate -> cache_lookup -> [features || retrieve || tools] -> route -> generate
         -> cache_store

A stage whose part is switched off in the settings is left out; ``Runner`` checks that what
is left still fits together (every field a stage reads is written before it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.runner import Concurrent, Stage, Step
from pipeline.stages.auth import Authenticate
from pipeline.stages.cache import CacheLookup, CacheStore, ResponseCache, no_index
from pipeline.stages.generate import Generate
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.route import ChooseRoute
from pipeline.stages.tools import PlannedTools
from pipeline.stages.validate import ValidateRequest
from pipeline.tools.planner import ToolPlanner

if TYPE_CHECKING:
    from app.services import Services
    from app.settings import Settings


def build_steps(settings: Settings, services: Services) -> list[Step]:
    steps: list[Step] = [
        Authenticate(services.keys, scope="chat"),
        ValidateRequest(
            routes=services.routes,
            context_length=settings.llm.context_length,
            server_tools=services.server_tools,
        ),
    ]
    features = features_stage(settings, services)
    cache = ResponseCache(
        services.kv, ttl=settings.cache.ttl_seconds, prefix=f"{settings.redis.key_prefix}cache:"
    )
    if settings.cache.enabled:
        version = services.retrieval.version if services.retrieval is not None else no_index
        steps.append(
            CacheLookup(
                cache,
                version,
                personalised=features is not None,
                versions=services.versions(),
            )
        )
    gathered = [
        stage
        for stage in (
            features,
            retrieve_stage(settings, services, with_features=features is not None),
            tools_stage(settings, services),
        )
        if stage is not None
    ]
    if len(gathered) > 1:
        steps.append(Concurrent(*gathered))
    else:
        steps.extend(gathered)
    route = route_stage(settings, services, with_features=features is not None)
    if route is not None:
        steps.append(route)
    steps.append(
        Generate(
            services.routes,
            services.chat,
            server_tools=services.server_tools,
            invoker=services.tool_invoker,
            max_rounds=settings.tools.max_rounds,
        )
    )
    if settings.cache.enabled:
        steps.append(CacheStore(cache))
    return steps


def retrieve_stage(settings: Settings, services: Services, *, with_features: bool) -> Stage | None:
    if services.retrieval is None:
        return None
    filters = services.feature_filters() if with_features else None
    return Retrieve(services.retrieval, feature_filters=filters)


def features_stage(settings: Settings, services: Services) -> Stage | None:
    """The user's features (the feature store's stage), when switched on."""
    from pipeline.stages.features import LoadFeatures

    config = settings.features
    if not config.enabled or services.features is None:
        return None
    return LoadFeatures(
        services.features,
        timeout_s=config.timeout_ms / 1000.0,
        log_requests=config.log_requests,
    )


def tools_stage(settings: Settings, services: Services) -> Stage | None:
    """The planned tools, run beside retrieval, when switched on."""
    if not settings.tools.enabled or services.tool_invoker is None:
        return None
    return PlannedTools(ToolPlanner(services.server_tools), services.tool_invoker)


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
        timeout_s=settings.routing.timeout_ms / 1000.0,
    )
